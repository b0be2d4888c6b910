"""The fused C++ verifier (``csrc/``: chain.cpp, candidates.cpp, sampled.cpp, sampled_tree.cpp,
block.cpp, block_tree.cpp, the sampled kernels' node step sampled.h, the rule part rules.h and the shared common.h;
verifiers/README.md, "Kernel layout"): build, load and call it.

``verify_chain`` and ``verify_candidates`` use it for sampled chains and tree nodes on the
CPU; the PyTorch code in :mod:`.chain` and :mod:`.candidates` is the other backend (any
device, T = 0, diagnostics, and the fallback). Both implement the same procedure, draw the
same uniforms and are tested against the same slow reference and closed forms.

The library is compiled on first use with the system C++ compiler (``$CXX``, else ``g++``;
about 3 s; see :mod:`.cbuild`) against torch's own thread pool (``at::parallel_for``: it follows
``torch.set_num_threads``), and cached under ``$HONEST_ROLLOUTS_CACHE`` (default
``~/.cache/honest-rollouts``) keyed by every source file, the compiler, torch version and CPU
flags.
``python -c 'from verifiers import native; native.main()'`` (``make native``) builds it ahead
of time and says where it is.

Numerics: exp is a vectorised polynomial, within 1 ulp of the correctly rounded float32 exp
over [-87, 0], that flushes e^x to 0 below x = -87: a token whose probability is under about
1.6e-38 of the row's largest counts as probability 0 (never emitted; a draft token there is
reported as having q = 0). Row sums are float32, sampling sums float64, closed forms
float64; results agree with the PyTorch path to about 1e-6 in log-prob, token for token on
the tests' inputs.

A rule runs here when its class declares a ``kernel_id`` (and its ``kernel_args``) in
:mod:`.rules`; :func:`params` builds the C struct from that declaration and checks it against
the kernel's own table (name and argument count under that id). A rule without a kernel id runs
on the PyTorch path.

``HONEST_ROLLOUTS_NATIVE``: ``auto`` (default: use it when it builds, else warn once and use
PyTorch), ``0`` (never), ``1`` (required: a failed build raises).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import time
from pathlib import Path

import torch
from torch import Tensor

from . import cbuild
from .results import CandidateResult, ChainResult

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))  # every file the library is built from
MAX_ARGS = 4  # kMaxArgs in csrc/common.h


class Params(ctypes.Structure):
    """Mirror of ``Params`` in csrc/common.h: a rule's kernel id and arguments."""

    _fields_ = [("rule", ctypes.c_int64), ("args", ctypes.c_double * MAX_ARGS)]


_lib: ctypes.CDLL | None = None
_tried = False
_load_lock = threading.Lock()
_override: bool | None = None  # set by ``forced`` (tests)


def _mode() -> str:
    return cbuild.mode()


def library_path() -> Path:
    """Where the compiled library for these sources, compiler, torch and CPU lives."""
    return cbuild.library_path("verifier", SOURCES)


def build() -> Path:
    """Compile the library if it is not cached; returns its path (raises on failure)."""
    return cbuild.build("verifier", SOURCES, "the fused verifier")


_i64, _f64, _ptr, _params = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p, ctypes.POINTER(Params)

# name -> (result type, argument types) of every entry point (tests/rollout/kernels/test_native_signatures.py
# checks them against the sources)
SIGNATURES: dict[str, tuple] = {
    "hr_verify_chain": (_i64, [_ptr] * 5 + [_i64] * 3 + [_f64, _params] + [_ptr] * 8),
    "hr_verify_candidates": (_i64, [_ptr] * 4 + [_i64] * 3 + [_f64, _params] + [_ptr] * 6),
    "hr_draw_sampled": (_i64, [_ptr] * 2 + [_i64] * 3 + [_f64] + [_ptr] * 2),
    "hr_verify_sampled": (_i64, [_ptr] * 5 + [_i64] * 3 + [_f64, _params] + [_ptr] * 5),
    "hr_walk_sampled": (_i64, [_ptr] * 7 + [_i64] * 7 + [_f64, _params] + [_ptr] * 7),
    "hr_verify_block": (_i64, [_ptr] * 5 + [_i64] * 3 + [_f64] + [_ptr] * 6),
    "hr_walk_block_tree": (_i64, [_ptr] * 8 + [_i64] * 5 + [_f64] + [_ptr] * 6),
    "hr_rule_name": (ctypes.c_char_p, [_i64]),
    "hr_rule_nargs": (_i64, [_i64]),
}


def _load() -> ctypes.CDLL | None:
    if _tried:
        return _lib
    with _load_lock:  # one build per process; other threads wait for it
        return _load_locked()


def _load_locked() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    try:
        lib = cbuild.open_library("verifier", SOURCES, "the fused C++ verifier", "the PyTorch one", SIGNATURES)
    except Exception:
        _tried = True  # one attempt per process
        raise
    if lib is None:
        _tried = True
        return None
    _lib, _tried = lib, True
    return lib


def enabled() -> bool:
    """Whether the C++ verifier is switched on (``HONEST_ROLLOUTS_NATIVE``, ``forced``) and built."""
    if _override is not None:
        return _override and _load() is not None
    return _mode() != "0" and _load() is not None


@contextlib.contextmanager
def forced(use: bool):
    """Use (True) or bypass (False) the C++ verifier inside the block; True raises if it cannot
    be built."""
    global _override
    if use and _load() is None:
        raise RuntimeError("the fused C++ verifier could not be built (see the warning above)")
    saved, _override = _override, use
    try:
        yield
    finally:
        _override = saved


@functools.lru_cache(maxsize=256)
def params(rule) -> Params:
    """The C struct for a rule with a kernel declaration (rules are frozen: cached per rule).
    Raises if the kernel implements another rule, or another argument count, under its id."""
    rid, args = rule.kernel_id, tuple(float(a) for a in rule.kernel_args())
    lib = _load()
    if lib is not None:
        name = lib.hr_rule_name(rid)
        if name is None or name.decode() != rule.name or lib.hr_rule_nargs(rid) != len(args):
            kernel = "nothing" if name is None else f"{name.decode()!r} with {lib.hr_rule_nargs(rid)} arguments"
            raise RuntimeError(f"rule {rule.name!r} declares kernel id {rid} with {len(args)} arguments, "
                               f"but the kernel implements {kernel} under that id")
    if len(args) > MAX_ARGS:
        raise ValueError(f"rule {rule.name!r} declares {len(args)} kernel arguments (at most {MAX_ARGS})")
    return Params(rid, (ctypes.c_double * MAX_ARGS)(*args))


def supports(rule) -> bool:
    """Whether ``rule`` declares a kernel id (rules without one run on the PyTorch path)."""
    return isinstance(getattr(rule, "kernel_id", None), int)


def usable(rule, temperature: float, device: torch.device) -> bool:
    """Whether a verification runs fused: sampled (T > 0), on the CPU, with a registered rule,
    the library enabled and built."""
    return temperature > 0 and device.type == "cpu" and enabled() and supports(rule)


class NativeError(Exception):
    """The kernel found bad inputs: ``status`` 1 (bad logit rows, ``bad_rows``), 2 (a draft
    token with q = 0 at ``bad_token``), 3 (nothing to sample from: a node's fallback or a
    chain row's final-token weights have no mass; an internal error) or 4 (token ids out of
    range, or candidates not distinct or padded before valid ones); the caller turns it into
    the user-facing error. The sampled-candidate kernels (``csrc/sampled.cpp``) use 1 (bad
    target or draft-logit rows), 2 (bad draft-logit rows of a node) and 4 (a candidate with
    q = 0); the block-tree walk (``csrc/block_tree.cpp``) also 5 (a token out of range) and 6 (an
    internal error: nothing to sample from)."""

    def __init__(self, status: int, bad_rows: Tensor, bad_token: tuple[int, int] = (-1, -1)):
        super().__init__(status)
        self.status, self.bad_rows, self.bad_token = status, bad_rows, bad_token


def verify_chain_native(rule, z_target: Tensor, z_draft: Tensor, x: Tensor, u_accept: Tensor,
                        u_final: Tensor, temperature: float) -> ChainResult:
    """One fused call. z_target [B, K+1, V] and z_draft [B, K, V] are float32 logits that the
    kernel divides by ``temperature`` (pass processed logits with temperature 1)."""
    lib = _load()
    b, k1, v = z_target.shape
    k = k1 - 1
    zt = z_target.float().contiguous()
    zd = z_draft.float().contiguous()
    xs = x.long().contiguous()
    ua, uf = u_accept.float().contiguous(), u_final.float().contiguous()
    tokens = torch.empty(b, k1, dtype=torch.long)
    num = torch.empty(b, dtype=torch.long)
    behaviour = torch.empty(b, k1, dtype=torch.float32)
    target_lp = torch.empty(b, k1, dtype=torch.float32)
    kinds = torch.empty(b, k1, dtype=torch.int8)
    relaxed = torch.empty(b, k1, dtype=torch.bool)
    bad_rows = torch.zeros(b * k1 + b * k, dtype=torch.uint8)
    bad_token = torch.zeros(2, dtype=torch.long)
    prm = params(rule)
    status = lib.hr_verify_chain(zt.data_ptr(), zd.data_ptr(), xs.data_ptr(), ua.data_ptr(), uf.data_ptr(),
                                 b, k, v, float(temperature), ctypes.byref(prm), tokens.data_ptr(),
                                 num.data_ptr(), behaviour.data_ptr(), target_lp.data_ptr(),
                                 kinds.data_ptr(), relaxed.data_ptr(), bad_rows.data_ptr(),
                                 bad_token.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows, tuple(bad_token.tolist()))
    return ChainResult(tokens, num, behaviour, target_lp, kinds, relaxed)


def verify_block_native(z_target: Tensor, z_draft: Tensor, x: Tensor, u_block: Tensor, u_final: Tensor,
                        temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``verifiers.block`` fused (``csrc/block.cpp``): z_target [B, K+1, V], z_draft [B, K, V] float32
    logits divided by ``temperature`` here, u_block [B, K+1] float64, u_final [B]; returns tokens
    [B, K+1] (-1 after the emitted ones), num_emitted [B], log p [B, K+1] (0 after), kinds [B, K+1]."""
    lib = _load()
    b, k1, v = z_target.shape
    zt, zd = z_target.float().contiguous(), z_draft.float().contiguous()
    xs, ub, uf = x.long().contiguous(), u_block.double().contiguous(), u_final.float().contiguous()
    tokens, num = torch.empty(b, k1, dtype=torch.long), torch.empty(b, dtype=torch.long)
    logp, kinds = torch.empty(b, k1, dtype=torch.float32), torch.empty(b, k1, dtype=torch.int8)
    bad_rows = torch.zeros(b * k1 + b * (k1 - 1), dtype=torch.uint8)
    bad_token = torch.zeros(2, dtype=torch.long)
    status = lib.hr_verify_block(zt.data_ptr(), zd.data_ptr(), xs.data_ptr(), ub.data_ptr(), uf.data_ptr(), b,
                                 k1 - 1, v, float(temperature), tokens.data_ptr(), num.data_ptr(), logp.data_ptr(),
                                 kinds.data_ptr(), bad_rows.data_ptr(), bad_token.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows, tuple(bad_token.tolist()))
    return tokens, num, logp, kinds


def walk_block_tree_native(z_target: Tensor, z_draft: Tensor, tokens: Tensor, children: Tensor, depths: Tensor,
                           u_block: Tensor, u_sibling: Tensor, u_final: Tensor,
                           temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``verifiers.block_tree`` fused (``csrc/block_tree.cpp``): z_target, z_draft [B, N+1, V] float32
    logits (divided by ``temperature`` here; the draft over the target vocabulary), tokens [B, N+1],
    children [N+1, K] (-1 padded), depths [N+1], u_block [B, W, W] float64, u_sibling [B, W, K]
    float32, u_final [B]; returns tokens [B, W] (-1 padded), emitted [B], log p [B, W] (0 padded),
    kinds [B, W] (``TokenKind`` values, -1 padded), path [B, W]."""
    lib = _load()
    b, n1, v = z_target.shape
    k, w = children.shape[1], u_block.shape[1]
    zt, zd = z_target.float().contiguous(), z_draft.float().contiguous()
    toks, kids, deps = tokens.long().contiguous(), children.long().contiguous(), depths.long().contiguous()
    ub, us, uf = u_block.double().contiguous(), u_sibling.float().contiguous(), u_final.float().contiguous()
    out, emitted = torch.empty(b, w, dtype=torch.long), torch.empty(b, dtype=torch.long)
    logp = torch.empty(b, w, dtype=torch.float32)
    kinds, path = torch.empty(b, w, dtype=torch.long), torch.empty(b, w, dtype=torch.long)
    bad_rows = torch.zeros(b, dtype=torch.uint8)
    status = lib.hr_walk_block_tree(zt.data_ptr(), zd.data_ptr(), toks.data_ptr(), kids.data_ptr(), deps.data_ptr(),
                                    ub.data_ptr(), us.data_ptr(), uf.data_ptr(), b, n1, v, k, w, float(temperature),
                                    out.data_ptr(), logp.data_ptr(), kinds.data_ptr(), path.data_ptr(),
                                    emitted.data_ptr(), bad_rows.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows, ())
    return out, emitted, logp, kinds, path


def main() -> None:
    start = time.perf_counter()
    path = build()
    print(f"fused C++ verifier: {path} ({time.perf_counter() - start:.1f} s)")
    ctypes.CDLL(str(path))



def _node_buffers(cands: Tensor, u_accept: Tensor, u_final: Tensor) -> tuple[Tensor, ...]:
    """A node kernel's contiguous inputs (candidates, uniforms) and its per-node outputs (tokens,
    accepted index, bad-row flags)."""
    n = cands.shape[0]
    return (cands.long().contiguous(), u_accept.float().contiguous(), u_final.float().contiguous(),
            torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long), torch.zeros(n, dtype=torch.uint8))


def verify_candidates_native(rule, z_target: Tensor, cands: Tensor, u_accept: Tensor, u_final: Tensor,
                             temperature: float) -> CandidateResult:
    """One fused call for N nodes: z_target [N, V] float32 logits (divided by ``temperature``
    here), cands [N, m] distinct, -1 padded after the valid ones."""
    lib = _load()
    n, v = z_target.shape
    m = cands.shape[1]
    zt = z_target.float().contiguous()
    cs, ua, uf, tokens, index, bad_rows = _node_buffers(cands, u_accept, u_final)
    behaviour = torch.empty(n, dtype=torch.float32)
    target_lp = torch.empty(n, dtype=torch.float32)
    relaxed = torch.empty(n, dtype=torch.bool)
    status = lib.hr_verify_candidates(zt.data_ptr(), cs.data_ptr(), ua.data_ptr(), uf.data_ptr(), n, m, v,
                                      float(temperature), ctypes.byref(params(rule)), tokens.data_ptr(),
                                      index.data_ptr(), behaviour.data_ptr(), target_lp.data_ptr(),
                                      relaxed.data_ptr(), bad_rows.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows)
    return CandidateResult(tokens, index, behaviour, target_lp, relaxed)


def draw_sampled_native(logits: Tensor, u: Tensor, temperature: float) -> Tensor:
    """``verifiers.sampled.draw_without_replacement`` fused: logits [R, V], u [m, R] float64;
    returns ids [R, m]."""
    lib = _load()
    r, v = logits.shape
    m = u.shape[0]
    lg = logits.float().contiguous()
    uu = u.double().contiguous()
    out = torch.empty(r, m, dtype=torch.long)
    bad_rows = torch.zeros(r, dtype=torch.uint8)
    status = lib.hr_draw_sampled(lg.data_ptr(), uu.data_ptr(), r, v, m, float(temperature), out.data_ptr(),
                                 bad_rows.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows)
    return out


def verify_sampled_native(rule, z_target: Tensor, z_draft: Tensor, cands: Tensor, u_accept: Tensor,
                          u_final: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``verifiers.sampled.verify_sampled_candidates`` fused: (tokens, index, log P(y), log p(y)),
    each [N]; P is p or ``rule``'s chain law (a rule with a kernel id)."""
    lib = _load()
    n, v = z_target.shape
    m = cands.shape[1]
    zt, zd = z_target.float().contiguous(), z_draft.float().contiguous()
    cs, ua, uf, tokens, index, bad_rows = _node_buffers(cands, u_accept, u_final)
    logp, target_lp = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    status = lib.hr_verify_sampled(zt.data_ptr(), zd.data_ptr(), cs.data_ptr(), ua.data_ptr(), uf.data_ptr(), n, m,
                                   v, float(temperature), ctypes.byref(params(rule)), tokens.data_ptr(),
                                   index.data_ptr(), logp.data_ptr(), target_lp.data_ptr(), bad_rows.data_ptr())
    if status != 0:
        raise NativeError(int(status), bad_rows)
    return tokens, index, logp, target_lp


def walk_sampled_native(rule, z_target: Tensor, z_draft: Tensor, draft_ids: Tensor, tokens: Tensor,
                        children: Tensor, u_accept: Tensor, u_final: Tensor, temperature: float) -> tuple[Tensor, ...]:
    """``rollout.engine.sampled_tree.walk_sampled`` fused: z_target [B, N+1, V], z_draft [B, ND, Vd] (row i:
    node i; ND <= N+1 when the nodes from ND on are leaves, as a chain's last node),
    draft_ids [Vd], tokens [B, N+1], children [N+1, K], u_accept [B, W, K], u_final [B, W]; returns
    (tokens, log P, log p, kinds, path) [B, W] and emitted [B] (P: p or ``rule``'s chain law)."""
    lib = _load()
    b, n1, v = z_target.shape
    nd, vd, k, w = z_draft.shape[1], z_draft.shape[-1], children.shape[1], u_final.shape[1]

    def bad_ids() -> ValueError:
        bad = draft_ids[(draft_ids < 0) | (draft_ids >= v)]
        return ValueError(f"draft_ids must hold one target id in [0, {v}) per draft logit ({vd}); got "
                          f"{len(draft_ids)} ids" + (f", {int(bad[0])} among them" if len(bad) else ""))

    if len(draft_ids) != vd:
        raise bad_ids()
    zt, zd = z_target.float().contiguous(), z_draft.float().contiguous()
    ids, toks, kids = draft_ids.long().contiguous(), tokens.long().contiguous(), children.long().contiguous()
    ua, uf = u_accept.float().contiguous(), u_final.float().contiguous()
    out = torch.empty(b, w, dtype=torch.long)
    logp, target_lp = torch.empty(b, w, dtype=torch.float32), torch.empty(b, w, dtype=torch.float32)
    kinds = torch.empty(b, w, dtype=torch.long)
    path = torch.empty(b, w, dtype=torch.long)
    emitted = torch.empty(b, dtype=torch.long)
    bad_rows = torch.zeros(b, dtype=torch.uint8)
    status = lib.hr_walk_sampled(zt.data_ptr(), zd.data_ptr(), ids.data_ptr(), toks.data_ptr(), kids.data_ptr(),
                                 ua.data_ptr(), uf.data_ptr(), b, n1, nd, v, vd, k, w, float(temperature),
                                 ctypes.byref(params(rule)), out.data_ptr(), logp.data_ptr(), target_lp.data_ptr(),
                                 kinds.data_ptr(), path.data_ptr(), emitted.data_ptr(), bad_rows.data_ptr())
    if status == 6:  # checked by the kernel (a few microseconds), not by torch ops on every call
        raise ValueError(f"z_draft has {nd} node rows, but a node from {nd} on has children (nodes: {n1})")
    if status == 5:
        raise bad_ids()
    if status != 0:
        raise NativeError(int(status), bad_rows)
    return out, logp, target_lp, kinds, path, emitted
