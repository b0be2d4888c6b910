"""rollout.native_lib's ctypes signatures against the C++ sources: ctypes passes an argument with
the type its declaration names, and a function it has no declaration for gets ints (a pointer
or an int64 cut to 32 bits, a float passed as an int). So every ``hr_`` function the sources
define or declare must be in ``SIGNATURES``, with its result type and each argument's type; the
test reads the sources as text and needs no compiler."""

from __future__ import annotations

import ctypes
import re

import pytest

from rollout import native_lib

_FUNCTION = re.compile(r"^(int64_t|uint64_t|void|float|double) (hr_\w+)\(([^)]*)\)", re.M)
_RESULTS = {"int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "void": None}


def _argument(text: str):
    """The ctypes type a C parameter is passed as."""
    text = text.strip()
    if "*" in text:
        return "pointer"
    ctype = text.rsplit(" ", 1)[0].replace("const ", "")
    return {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}[ctype]


def _passed_as(t):
    return "pointer" if t is ctypes.c_void_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer)) else t


def c_functions() -> list[tuple[str, str, object, list]]:
    """(file, name, result type, argument types) of every ``hr_`` definition or declaration."""
    found = []
    for path in native_lib.SOURCES:
        for m in _FUNCTION.finditer(path.read_text()):
            params = [p for p in m.group(3).split(",") if p.strip()]
            found.append((path.name, m.group(2), _RESULTS[m.group(1)], [_argument(p) for p in params]))
    return found


def test_the_sources_are_read():
    names = {name for _, name, _, _ in c_functions()}
    assert {"hr_linear", "hr_linear_amx", "hr_digest_many", "hr_decoder_stack", "hr_draft_chain"} <= names


@pytest.mark.parametrize("where,name,result,args", c_functions(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_c_function_is_declared_with_its_types(where, name, result, args):
    assert name in native_lib.SIGNATURES, f"{name} ({where}) has no ctypes signature in rollout.native_lib"
    restype, argtypes = native_lib.SIGNATURES[name]
    assert restype is result, f"{name}: result {restype} in native_lib, {result} in {where}"
    assert [_passed_as(t) for t in argtypes] == args, f"{name}: argument types differ from {where}"


def test_every_signature_names_a_c_function():
    assert set(native_lib.SIGNATURES) == {name for _, name, _, _ in c_functions()}
