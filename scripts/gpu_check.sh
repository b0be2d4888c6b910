#!/usr/bin/env bash
# The prepared GPU check: every `gpu`-marked test, in one command, on a GPU machine.
#
#   bash scripts/gpu_check.sh        (from the repository root, with the ignored .whl/ folder beside it)
#
# Where python has no pytest, installs the wheels carried in .whl/ (pytest and its needs;
# `bash scripts/gpu_wheels.sh` fetches them) into $GPU_CHECK_SITE (default /tmp/site); prints the
# versions, then runs pytest -m gpu over GPU_TESTS (plugins off) under a time limit
# ($GPU_CHECK_TIMEOUT s, default 330, so the script ends within ~6 min).
# Everything goes to the terminal and, when OUT is set, to $OUT/gpu_check.log. Exits with pytest's
# status (124: the time limit). Needs torch, transformers, numpy, pyyaml, tqdm; no Ray, TRL, gguf,
# vLLM or scipy. The C++ kernels are off (HONEST_ROLLOUTS_NATIVE=0): CUDA never runs them.
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_TESTS=(
    tests/verifiers/test_verifiers_montecarlo.py
    tests/verifiers/test_truncation_sampling.py
    tests/verifiers/test_verifiers_cuda.py
    tests/verifiers/test_block_tree_backends.py
    tests/rollout/engine/test_engine_cuda.py
    tests/trainers/drafter/test_drafter_data.py
)
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
LIMIT=${GPU_CHECK_TIMEOUT:-330}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MKL_CBWR=AVX2 TOKENIZERS_PARALLELISM=false
export HONEST_ROLLOUTS_NATIVE=${HONEST_ROLLOUTS_NATIVE:-0}
# the project's tests use no pytest plugin; one installed beside another pytest could break the run
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

check() {
    if "$PY" -c "import pytest" 2>/dev/null; then
        echo "== pytest is installed here: the wheels in .whl/ are not needed"
    elif compgen -G ".whl/*.whl" >/dev/null; then
        echo "== installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl || { echo "gpu_check: installing the wheels failed"; return 3; }
    fi
    echo "== versions"
    "$PY" - <<'EOF' || return 4
import sys

import pytest
import torch
import transformers

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| transformers", transformers.__version__, "| pytest", pytest.__version__, "from", pytest.__file__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (the gpu tests skip)")
EOF
    echo "== pytest -m gpu (limit ${LIMIT} s): ${GPU_TESTS[*]}"
    timeout -k 10 "$LIMIT" "$PY" -m pytest -m gpu -p no:cacheprovider -v -rs --durations=10 "${GPU_TESTS[@]}"
    local status=$?
    [ "$status" -eq 124 ] && echo "gpu_check: pytest ran past ${LIMIT} s and was stopped"
    echo "== gpu_check: exit status $status"
    return "$status"
}

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    check 2>&1 | tee "$OUT/gpu_check.log"
else
    check 2>&1
fi
exit "${PIPESTATUS[0]}"
