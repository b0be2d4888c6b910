"""glibc malloc settings that keep freed tensor memory for reuse (CPU inference and training).

PyTorch's CPU tensors come from malloc. glibc serves a block above its mmap threshold
(128 KiB at start, raised dynamically up to 32 MiB) with fresh pages from the kernel and
unmaps it on free, and it returns free memory at the top of the heap to the kernel once
more than 128 KiB is free. Every vocabulary-sized temporary (a [8, 49152] float32 softmax
is 1.5 MiB) is then page-faulted in again on each call; on this project's VM that fault
cost exceeds the arithmetic. Fixing the mmap threshold at its 32 MiB maximum and the trim
threshold at 1 GiB makes freed blocks stay in the heap and be reused.

Measured on a 2-core CPU: an elementwise pass over
[40, 49152] float32 rows 2-6x faster, chain verification at B = 8 1.2-1.5x faster, engine
tokens/s about 7% higher. The cost: up to 1 GiB of freed memory stays mapped to the process
(resident memory stays at its high-water mark instead of shrinking).

The settings are process-wide; the engine applies them when it runs on the CPU, and so do
the scripts. ``HONEST_ROLLOUTS_MALLOC=default`` in the environment leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (larger values are refused)
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def _mallopt():
    """glibc's mallopt, or None (another libc, or not Linux)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libc, "mallopt", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def tune_malloc() -> bool:
    """Apply the settings once per process; True if glibc accepted them. A no-op returning
    False where there is no glibc or ``HONEST_ROLLOUTS_MALLOC=default``."""
    global _applied
    if _applied is None:
        if os.environ.get("HONEST_ROLLOUTS_MALLOC", "tuned") == "default":
            _applied = False
        else:
            fn = _mallopt()
            _applied = bool(fn is not None and fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                            and fn(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
