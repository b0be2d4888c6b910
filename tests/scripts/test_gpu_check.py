"""``scripts/gpu_check.sh`` runs ``pytest -m gpu`` over the files in its ``GPU_TESTS`` list only
(the whole tree would import Ray, TRL and vLLM, which the GPU machine lacks). A ``gpu`` test in
a file the list leaves out would never run there, and a listed file without one is a stale entry:
the list must be exactly the files pytest collects ``gpu`` tests from, and they must import on
that machine, which has no Ray, TRL, gguf, vLLM or scipy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def listed_files() -> set[str]:
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    body = re.search(r"^GPU_TESTS=\(\n(.*?)^\)", script, re.M | re.S)
    assert body, "gpu_check.sh has no GPU_TESTS=( ... ) list"
    return {line.strip() for line in body.group(1).splitlines() if line.strip()}


def collected_files(pytest_output: str) -> set[str]:
    """The test files of ``pytest --collect-only -q``'s listing."""
    return {line.split("::")[0] for line in pytest_output.splitlines() if "::" in line}


def test_gpu_check_runs_every_file_with_gpu_tests():
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    collected = collected_files(out.stdout)
    assert collected, "no gpu-marked test was collected"
    assert listed_files() == collected, (f"not in GPU_TESTS: {sorted(collected - listed_files())}; "
                                         f"listed without a gpu test: {sorted(listed_files() - collected)}")
    assert all((ROOT / f).is_file() for f in listed_files())


ABSENT_THERE = ("ray", "trl", "gguf", "vllm", "scipy")  # not installed on the GPU machine (scripts/gpu_check.sh)


def test_the_listed_files_collect_without_what_the_gpu_machine_lacks():
    """Collected as gpu_check.sh collects them, with Ray, TRL, gguf, vLLM and scipy made absent
    (``sys.modules[name] = None``: an import fails, ``importlib.util.find_spec`` says absent) and
    the C++ kernels off: every listed file imports and yields its gpu tests."""
    blocked = "".join(f"sys.modules[{name!r}] = None; " for name in ABSENT_THERE)
    code = (f"import sys; {blocked}import pytest; "
            f"sys.exit(pytest.main(['-m', 'gpu', '--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")
    out = subprocess.run([sys.executable, "-c", code, *sorted(listed_files())], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HONEST_ROLLOUTS_NATIVE": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert collected_files(out.stdout) == listed_files()
