"""The ctypes signatures of the two C++ libraries (``rollout.kernels.native_lib``: the decoding kernels;
``verifiers.native``: the fused verifier) against their sources: ctypes passes an argument with
the type its declaration names, and a function it has no declaration for gets ints (a pointer
or an int64 cut to 32 bits, a float passed as an int). So every ``hr_`` function the sources
define or declare must be in the library's ``SIGNATURES``, with its result type and each
argument's type; the test reads the sources as text and needs no compiler."""

from __future__ import annotations

import ctypes
import re

import pytest

from rollout.kernels import native_lib
from verifiers import native

LIBRARIES = {"rollout": native_lib, "verifiers": native}

_FUNCTION = re.compile(r"^(int64_t|uint64_t|void|const char\*) (hr_\w+)\(([^)]*)\)", re.M)
_RESULTS = {"int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "void": None, "const char*": ctypes.c_char_p}


def _argument(text: str):
    """The ctypes type a C parameter is passed as."""
    text = text.strip()
    if "*" in text:
        return "pointer"
    ctype = text.rsplit(" ", 1)[0].replace("const ", "")
    return {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}[ctype]


def _passed_as(t):
    return "pointer" if t is ctypes.c_void_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer)) else t


def c_functions(library: str) -> list[tuple[str, str, object, list]]:
    """(file, name, result type, argument types) of every ``hr_`` definition or declaration in the
    sources of ``library``."""
    found = []
    for path in LIBRARIES[library].SOURCES:
        for m in _FUNCTION.finditer(path.read_text()):
            params = [p for p in m.group(3).split(",") if p.strip()]
            found.append((path.name, m.group(2), _RESULTS[m.group(1)], [_argument(p) for p in params]))
    return found


def test_the_sources_are_read():
    rollout = {name for _, name, _, _ in c_functions("rollout")}
    assert {"hr_linear", "hr_linear_amx", "hr_digest_many", "hr_decoder_stack", "hr_draft_chain"} <= rollout
    verifiers = {name for _, name, _, _ in c_functions("verifiers")}
    assert {"hr_verify_chain", "hr_walk_block_tree", "hr_rule_name"} <= verifiers


@pytest.mark.parametrize("library,where,name,result,args",
                         [(lib, *f) for lib in LIBRARIES for f in c_functions(lib)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_c_function_is_declared_with_its_types(library, where, name, result, args):
    signatures = LIBRARIES[library].SIGNATURES
    assert name in signatures, f"{name} ({where}) has no ctypes signature in {library}'s library"
    restype, argtypes = signatures[name]
    assert restype is result, f"{name}: result {restype} declared, {result} in {where}"
    assert [_passed_as(t) for t in argtypes] == args, f"{name}: argument types differ from {where}"


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_signature_names_a_c_function(library):
    assert set(LIBRARIES[library].SIGNATURES) == {name for _, name, _, _ in c_functions(library)}
