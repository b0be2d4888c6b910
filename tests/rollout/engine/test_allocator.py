"""rollout/engine/allocator.py: glibc keeps freed tensor-sized blocks in the heap once tuned."""

import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.engine import allocator

_PROBE = textwrap.dedent("""
    import ctypes, sys
    from rollout.engine.allocator import tune_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    applied = tune_malloc()
    block = libc.malloc(16 << 20)  # a 16 MiB tensor's worth: mmap'd by default glibc
    mapped = libc.mallinfo2().hblkhd
    libc.free(block)
    print(int(applied), int(mapped >= (16 << 20)))
""")


def _probe(mode: str) -> tuple[int, int]:
    env = {"HONEST_ROLLOUTS_MALLOC": mode, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(allocator.__file__).parents[2])
    applied, mapped = out.stdout.split()
    return int(applied), int(mapped)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33")
def test_tuned_malloc_serves_large_blocks_from_the_heap():
    assert _probe("default") == (0, 1)  # stock glibc: a fresh mapping, unmapped again on free
    assert _probe("tuned") == (1, 0)  # tuned: heap memory, kept for reuse after free


def test_tune_malloc_applies_once(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    calls = []
    monkeypatch.setattr(allocator, "_mallopt", lambda: (lambda param, value: calls.append((param, value)) or 1))
    assert allocator.tune_malloc() is True
    assert allocator.tune_malloc() is True
    assert calls == [(allocator.M_MMAP_THRESHOLD, 32 << 20), (allocator.M_TRIM_THRESHOLD, 1 << 30)]


def test_tune_malloc_reports_a_refusal(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: (lambda param, value: 0))
    assert allocator.tune_malloc() is False
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)  # no glibc
    assert allocator.tune_malloc() is False
