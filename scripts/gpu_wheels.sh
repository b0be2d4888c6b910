#!/usr/bin/env bash
# Fetch into .whl/ (ignored by git) the wheels that scripts/gpu_check.sh installs on the GPU machine,
# which has torch, transformers, numpy, pyyaml, tqdm but no pytest: pytest and what it requires on
# CPython 3.12 (pluggy, iniconfig, packaging, pygments; its other needs are for Python < 3.11 or
# Windows), pinned, for x86-64 Linux. Needs pip and PyPI here; .whl/ then travels with the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=(pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0)

mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
