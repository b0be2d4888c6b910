"""Compiling and caching the project's C++ libraries (the fused verifier, ``verifiers/csrc``;
the decoding linear layer, ``rollout/kernels/csrc``).

A library is built on first use with the system C++ compiler (``$CXX``, else ``g++``) for this
CPU (``-march=native``), against torch's headers and thread pool (``at::parallel_for`` follows
``torch.set_num_threads``), and cached under ``$HONEST_ROLLOUTS_CACHE`` (default
``~/.cache/honest-rollouts``) in ``native/``, keyed by every source file, the compile command,
the compiler version, the torch version and the CPU flags. Builds are atomic: concurrent
builders (Ray workers) never see a partial file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch


def cache_dir() -> Path:
    root = os.environ.get("HONEST_ROLLOUTS_CACHE") or "~/.cache/honest-rollouts"
    return Path(root).expanduser() / "native"


def cpu_flags() -> str:
    """The CPU's feature line (x86 'flags', ARM 'Features'), with the machine name: libraries
    are built for this CPU (-march=native)."""
    try:
        with open("/proc/cpuinfo") as fh:
            line = next((ln for ln in fh if ln.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    return platform.machine() + " " + line


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=60).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def command(sources: list[Path], out: Path) -> list[str]:
    """The compile command for the ``.cpp`` files among ``sources`` into the shared library ``out``."""
    tdir = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [os.environ.get("CXX", "g++"), "-O3", "-std=gnu++17", "-march=native", "-fopenmp",
            "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC", "-shared",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{tdir / 'include'}", *(str(s) for s in sources if s.suffix == ".cpp"), "-o", str(out),
            f"-L{tdir / 'lib'}",
            "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{tdir / 'lib'}"]


def library_path(name: str, sources: list[Path]) -> Path:
    """Where the compiled library ``name`` for these sources, compiler, torch and CPU lives."""
    key = hashlib.sha256()
    for source in sources:
        key.update(source.name.encode())
        key.update(source.read_bytes())
    cmd = command(sources, Path("x"))
    key.update(" ".join(cmd).encode())
    key.update(_compiler_version(cmd[0]).encode())
    key.update(torch.__version__.encode())
    key.update(cpu_flags().encode())
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str, sources: list[Path], what: str) -> Path:
    """Compile library ``name`` (described as ``what`` in errors) if it is not cached; returns its
    path (raises RuntimeError on failure)."""
    path = library_path(name, sources)
    if path.exists():
        return path
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set $CXX, or HONEST_ROLLOUTS_NATIVE=0)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    proc = subprocess.run(command(sources, tmp), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building {what} ({sources[0].parent}) failed:\n{proc.stderr[-4000:]}")
    os.replace(tmp, path)
    return path


def mode() -> str:
    """``HONEST_ROLLOUTS_NATIVE``: ``auto`` (default), ``0`` (never use the C++ libraries) or ``1``
    (required: a failed build raises)."""
    value = os.environ.get("HONEST_ROLLOUTS_NATIVE", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"HONEST_ROLLOUTS_NATIVE must be one of auto, 0, 1; got {value!r}")
    return value


def open_library(name: str, sources: list[Path], what: str, fallback: str,
                 signatures: dict[str, tuple]) -> ctypes.CDLL | None:
    """Build (when not cached) and open library ``name``, with the result and argument types of
    each entry point set from ``signatures`` (name -> (result type, argument types)): ctypes then
    passes every argument as the C type the function takes. On failure: raise under
    ``HONEST_ROLLOUTS_NATIVE=1``, else warn that ``what`` is unavailable and ``fallback`` runs
    instead, and return None."""
    try:
        lib = ctypes.CDLL(str(build(name, sources, what)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        if mode() == "1":
            raise
        warnings.warn(f"{what} is unavailable, using {fallback}: {err}", RuntimeWarning, stacklevel=4)
        return None
    for entry, (restype, argtypes) in signatures.items():
        fn = getattr(lib, entry)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
