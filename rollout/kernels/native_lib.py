"""The C++ library of ``rollout/kernels/csrc``: its source files and its functions' ctypes signatures.

One shared library (built by ``verifiers/cbuild.py``, keyed by every file below) holds the
decoding linear kernel (``linear.cpp``, over the panels that ``pack.cpp`` packs, in the layout of
``panels.h``; ``amx.cpp``: bf16-valued weights on Intel AMX tiles), the weight digest
(``digest.cpp``), attention (``attention.cpp``), RMS norm (``norm.cpp``) and the fused decoder and
draft layers (``layer.cpp``). :func:`load` opens it once
per process (``_lib``, which :mod:`rollout.kernels.native_linear`, :mod:`rollout.kernels.native_ops`,
:mod:`rollout.kernels.native_layers` and :mod:`rollout.kernels.native_draft` call), with every entry point's types
set from :data:`SIGNATURES` (``cbuild.open_library``): ctypes then passes every argument with the C
type the function takes (a Python float as ``float``, an int as ``int64_t``) and reads every result
as its C type.
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
            lib = cbuild.open_library("linear", SOURCES, "the native linear kernel", "torch's GEMM", SIGNATURES)
        except Exception:
            _tried = True
            raise
        if lib is None:
            _tried = True
            return None
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


_i64, _u64, _f32, _ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_float, ctypes.c_void_p
_KERNEL = [_ptr] * 4 + [_i64] * 3  # (panels, bias, x, y, N, K, M): every linear kernel
_PACK = [_ptr] * 2 + [_i64] * 2  # (weight, out, N, K)

# name -> (result type, argument types) of every entry point (tests/rollout/kernels/test_native_signatures.py checks them
# against the sources)
SIGNATURES: dict[str, tuple] = {
    "hr_linear": (_i64, _KERNEL),
    "hr_linear16": (_i64, _KERNEL),
    "hr_linear8": (_i64, _KERNEL),
    "hr_linear_amx": (_i64, _KERNEL),
    "hr_linear_pack": (None, _PACK),
    "hr_linear_pack16": (_i64, _PACK),
    "hr_linear_pack_amx": (_i64, _PACK),
    "hr_linear_pack8": (_i64, [_ptr] * 3 + [_i64] * 2),
    "hr_linear_packed_size": (_i64, [_i64] * 2),
    "hr_linear_packed_size8": (_i64, [_i64] * 2),
    "hr_amx_built": (_i64, []),
    "hr_amx_enable": (_i64, []),
    "hr_linear_max_rows": (_i64, []),
    "hr_linear_vectorised": (_i64, []),
    "hr_digest": (_u64, [_ptr, _i64]),
    "hr_digest_many": (None, [ctypes.POINTER(_ptr), ctypes.POINTER(_i64), _i64, ctypes.POINTER(_u64)]),
    "hr_attend": (_i64, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr]
                  + [_i64] * 6 + [_f32]),
    "hr_attend_vectorised": (_i64, []),
    "hr_rms_norm": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "hr_decoder_layer": (_i64, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _f32] + [_ptr] * 4 + [_i64] * 5 + [_ptr] * 4
                         + [_i64] * 3 + [_ptr, _ptr, _i64, _i64, _i64, _f32, _ptr]),
    "hr_decoder_layer_scratch": (_i64, [_i64] * 6),
    "hr_decoder_stack": (_i64, [_ptr, _i64, _i64, _i64, _i64, _ptr, _f32] + [_i64] * 4 + [_ptr, _ptr] + [_i64] * 3
                         + [_ptr, _ptr] + [_i64] * 3 + [_f32, _ptr, _ptr]),
    "hr_draft_layer": (_i64, [_ptr] * 3 + [_i64] * 3 + [_ptr] * 3 + [_f32] + [_ptr] * 4 + [_i64] * 5 + [_ptr] * 4
                       + [_i64] * 3 + [_ptr] * 2 + [_i64] * 3 + [_f32, _ptr, _ptr, _i64, _f32, _ptr, _ptr]),
    "hr_draft_layer_scratch": (_i64, [_i64] * 6),
    "hr_draft_chain": (_i64, [_ptr] * 6 + [_f32] + [_i64] * 3 + [_ptr] * 3 + [_f32] + [_ptr] * 4 + [_i64] * 5
                       + [_ptr] * 4 + [_i64] * 3 + [_ptr, _i64, _i64, _f32, _ptr, _ptr, _i64, _f32, _ptr]),
    "hr_draft_chain_scratch": (_i64, [_i64] * 7),
}

