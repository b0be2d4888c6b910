"""The C++ library of ``rollout/csrc``: its source files and its functions' ctypes signatures.

One shared library (built by ``verifiers/cbuild.py``, keyed by every file below) holds the
decoding linear kernel (``linear.cpp``, over the panels that ``pack.cpp`` packs, in the layout of
``panels.h``; ``amx.cpp``: bf16-valued weights on Intel AMX tiles), the weight digest
(``digest.cpp``), attention (``attention.cpp``), RMS norm (``norm.cpp``) and the fused decoder and
draft layers (``layer.cpp``). :func:`load` opens it once
per process (``_lib``, which :mod:`rollout.native_linear`, :mod:`rollout.native_ops`,
:mod:`rollout.native_layers` and :mod:`rollout.native_draft` call) and runs :func:`declare` on it
first: ctypes then passes every argument with the C type the function takes (a Python float as
``float``, an int as ``int64_t``) and reads every result as its C type.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from verifiers import cbuild

CSRC = Path(__file__).with_name("csrc")
# every file the library is built from: a change to any of them (the header too) rebuilds it
SOURCES = [CSRC / name for name in ("linear.cpp", "pack.cpp", "amx.cpp", "attention.cpp", "norm.cpp", "layer.cpp",
                                    "digest.cpp", "panels.h")]

_lib: ctypes.CDLL | None = None  # the opened library (None: not loaded, or not usable here)
_tried = False  # one attempt per process
_lock = threading.Lock()


def load() -> ctypes.CDLL | None:
    """The library, built and opened on the first call (None where it cannot be, or where it was
    built without AVX-512: then every caller runs torch's path)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            lib = cbuild.open_library("linear", SOURCES, "the native linear kernel", "torch's GEMM")
        except Exception:
            _tried = True
            raise
        if lib is None:
            _tried = True
            return None
        declare(lib)
        _lib, _tried = (lib if lib.hr_linear_vectorised() else None), True
        return _lib


def available() -> bool:
    """Whether the library is switched on (``HONEST_ROLLOUTS_NATIVE`` != 0), built and vectorised."""
    return cbuild.mode() != "0" and load() is not None


def required() -> ctypes.CDLL:
    """The library, loaded (a pack or a digest may be the process's first call into it); a clear
    error where it is not available."""
    if not available():
        raise RuntimeError("the native linear kernel is not available here: it needs an x86 CPU with AVX-512 and "
                           "a C++ compiler, and HONEST_ROLLOUTS_NATIVE=0 turns it off (native_linear.available())")
    return _lib


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and result types of every entry point of the opened library ``lib``."""
    lib.hr_linear.restype = ctypes.c_int64
    lib.hr_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.hr_linear_pack.restype = None
    lib.hr_linear_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.hr_linear_packed_size.restype = ctypes.c_int64
    lib.hr_linear_packed_size.argtypes = [ctypes.c_int64] * 2
    lib.hr_linear16.restype = ctypes.c_int64
    lib.hr_linear16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.hr_linear_pack16.restype = ctypes.c_int64
    lib.hr_linear_pack16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.hr_linear8.restype = ctypes.c_int64
    lib.hr_linear8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.hr_linear_pack8.restype = ctypes.c_int64
    lib.hr_linear_pack8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.hr_linear_packed_size8.restype = ctypes.c_int64
    lib.hr_linear_packed_size8.argtypes = [ctypes.c_int64] * 2
    lib.hr_amx_built.restype = ctypes.c_int64
    lib.hr_amx_built.argtypes = []
    lib.hr_amx_enable.restype = ctypes.c_int64
    lib.hr_amx_enable.argtypes = []
    lib.hr_linear_amx.restype = ctypes.c_int64
    lib.hr_linear_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.hr_linear_pack_amx.restype = ctypes.c_int64
    lib.hr_linear_pack_amx.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.hr_digest.restype = ctypes.c_uint64
    lib.hr_digest.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.hr_digest_many.restype = None
    lib.hr_digest_many.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                   ctypes.POINTER(ctypes.c_uint64)]
    lib.hr_linear_max_rows.restype = ctypes.c_int64
    lib.hr_linear_vectorised.restype = ctypes.c_int64
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hr_attend.restype = i64
    lib.hr_attend.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr] + [i64] * 6 + [
        ctypes.c_float]
    lib.hr_attend_vectorised.restype = i64
    lib.hr_rms_norm.restype = None
    lib.hr_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
    f32 = ctypes.c_float
    lib.hr_decoder_layer.restype = i64
    lib.hr_decoder_layer.argtypes = ([ptr, i64, i64, i64, ptr, ptr, f32] + [ptr] * 4 + [i64] * 5 + [ptr] * 4
                                     + [i64] * 3 + [ptr, ptr, i64, i64, i64, f32, ptr])
    lib.hr_decoder_layer_scratch.restype = i64
    lib.hr_decoder_layer_scratch.argtypes = [i64] * 6
    lib.hr_decoder_stack.restype = i64
    lib.hr_decoder_stack.argtypes = ([ptr, i64, i64, i64, i64, ptr, f32] + [i64] * 4 + [ptr, ptr] + [i64] * 3
                                     + [ptr, ptr] + [i64] * 3 + [f32, ptr, ptr])
    lib.hr_draft_layer.restype = i64
    lib.hr_draft_layer.argtypes = ([ptr] * 3 + [i64] * 3 + [ptr] * 3 + [f32] + [ptr] * 4 + [i64] * 5 + [ptr] * 4
                                   + [i64] * 3 + [ptr] * 2 + [i64] * 3 + [f32, ptr, ptr, i64, f32, ptr, ptr])
    lib.hr_draft_layer_scratch.restype = i64
    lib.hr_draft_layer_scratch.argtypes = [i64] * 6
    lib.hr_draft_chain.restype = i64
    lib.hr_draft_chain.argtypes = ([ptr] * 6 + [f32] + [i64] * 3 + [ptr] * 3 + [f32] + [ptr] * 4 + [i64] * 5
                                   + [ptr] * 4 + [i64] * 3 + [ptr, i64, i64, f32, ptr, ptr, i64, f32, ptr])
    lib.hr_draft_chain_scratch.restype = i64
    lib.hr_draft_chain_scratch.argtypes = [i64] * 7
