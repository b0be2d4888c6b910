"""Verification rules: what each rule accepts, what it samples after a rejection, and the
closed form of the distribution it induces (VERIFICATION.md, the two tables).

Vocabulary: p is the processed target distribution, q the draft distribution (both [..., V],
see :mod:`verifiers.processing`), z the processed target logits. A rule first computes a
per-row *context* from z and p (for example MARS's top-2 tokens and its relax flag, or the
probability threshold of a min-p / typical set A = {v : p(v) >= thr}); the other methods take it.

Chain mode (a sampled draft x ~ q): accept x with probability a(x) = ``accept_prob``, else
emit from the unnormalised residual ``residual(p, q, x)``; ``induced`` is the closed form
P = sum_x q(x) [a(x) delta_x + (1 - a(x)) r_x]. ``chain_stats`` reduces full rows to what
``prob_at`` needs to evaluate P(y) from gathered values (so the batched verifier never builds
full P rows).

Candidate mode (deterministic candidates c_1..c_m of one node): ``node_alpha`` gets s(c_i), the
probability of c_i under p with c_1..c_{i-1} zeroed and renormalised (the lossless state),
and p(c_i); it returns alpha_i. If every candidate is rejected the token comes from
``node_fallback``.

Greedy (T = 0): every rule accepts x iff x is the target argmax v1, except MARS, which also
accepts v2 when its ratio test on the raw logits holds (``greedy_second``). The cos rule has no
deterministic form of its own, so at T = 0 it is greedy like the others (our choice).

All methods are batched over leading dims; the rules are frozen dataclasses, built by name
with :func:`get_rule`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from .processing import top2

Context = dict[str, Tensor]


@runtime_checkable
class VerificationRule(Protocol):
    """The interface every registered rule implements (see the module docstring)."""

    name: str

    def context(self, z: Tensor, p: Tensor) -> Context: ...
    def accept_prob(self, p_x: Tensor, q_x: Tensor, x: Tensor, ctx: Context) -> Tensor: ...
    def residual(self, p: Tensor, q: Tensor, x: Tensor, ctx: Context) -> Tensor: ...
    def induced(self, p: Tensor, q: Tensor, ctx: Context) -> Tensor: ...
    def chain_stats(self, p: Tensor, q: Tensor, ctx: Context) -> dict[str, Tensor]: ...
    def prob_at(self, p_y: Tensor, q_y: Tensor, y: Tensor, ctx: Context,
                stats: dict[str, Tensor]) -> Tensor: ...
    def induces_target(self, ctx: Context) -> Tensor | bool: ...
    def node_alpha(self, s_c: Tensor, p_c: Tensor, c: Tensor, ctx: Context) -> Tensor: ...
    def node_fallback(self, p: Tensor, p_rest: Tensor, ctx: Context) -> Tensor: ...
    def greedy_second(self, logits: Tensor) -> tuple[Tensor, Tensor] | None: ...


def lossless_residual(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalised R = (p - q)+ [..., V]; p itself on rows where p <= q everywhere (TV = 0 guard)."""
    w = (p - q).clamp_(min=0)
    empty = w.sum(-1, keepdim=True) <= 0  # [..., 1]
    return torch.where(empty, p, w) if bool(empty.any()) else w


def _lossless_accept(p_x: Tensor, q_x: Tensor) -> Tensor:
    return (p_x / q_x).clamp_(max=1)


def _expand(t: Tensor, like: Tensor) -> Tensor:
    """A per-row value [...] broadcast against [..., n] when ``like`` has one more dim."""
    return t.unsqueeze(-1) if like.dim() > t.dim() else t


def _below01(p: Tensor, thr: Tensor) -> Tensor:
    """(p < thr) as float32 ones and zeros [..., V] (thr [...]): written as float directly, which is
    several times faster over a vocabulary row on the CPU than a bool mask and where/masked_fill.
    Multiplying a finite x >= 0 by it equals ``torch.where(p >= thr, 0.0, x)`` exactly."""
    return torch.lt(p, _expand(thr, p), out=torch.empty_like(p))


class _RuleBase:
    """Defaults: the lossless rule (subclasses override what differs)."""

    name: ClassVar[str]
    # chain_stats reduces whole vocabulary rows (worth computing only at the positions read)
    full_row_stats: ClassVar[bool] = False

    def context(self, z: Tensor, p: Tensor) -> Context:
        return {}

    def accept_prob(self, p_x, q_x, x, ctx):
        return _lossless_accept(p_x, q_x)

    def residual(self, p, q, x, ctx):
        return lossless_residual(p, q)

    def induced(self, p, q, ctx):
        return p

    def chain_stats(self, p, q, ctx):
        return {}

    def prob_at(self, p_y, q_y, y, ctx, stats):
        return p_y

    def induces_target(self, ctx: Context) -> Tensor | bool:
        """True (or a per-row mask) where P == p exactly, so log P(y) = log p(y)."""
        return False

    def node_alpha(self, s_c, p_c, c, ctx):
        return s_c

    def node_fallback(self, p, p_rest, ctx):
        return p_rest

    def greedy_second(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """At T = 0: (mask of rows where v2 is also accepted, v2), or None (never)."""
        return None


def _check_range(rule: str, param: str, value: Any, low: float, high: float,
                 low_open: bool, text: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise ValueError(f"rule {rule!r}: parameter {param!r} must be in {text}, got {value!r}")


@dataclass(frozen=True)
class Lossless(_RuleBase):
    """Standard speculative sampling: a = min(1, p/q), residual norm((p - q)+), P = p."""

    name: ClassVar[str] = "lossless"

    def induces_target(self, ctx):
        return True


@dataclass(frozen=True)
class Mars(_RuleBase):
    """MARS: where z1 > 0 and z2/z1 > theta (top-2 processed logits), accept v1 and v2 outright
    and fall back to p itself; elsewhere exactly lossless. The z1 > 0 guard is ours."""

    theta: float = 0.9
    name: ClassVar[str] = "mars"

    def __post_init__(self):
        _check_range(self.name, "theta", self.theta, 0, 1, False, "[0, 1]")

    def _relax(self, z1: Tensor, z2: Tensor) -> Tensor:
        return (z1 > 0) & (z2 / z1 > self.theta)

    def context(self, z, p):
        z1, z2, v1, v2 = top2(z)
        return {"relax": self._relax(z1, z2), "v1": v1, "v2": v2}

    def _in12(self, tok: Tensor, ctx: Context) -> Tensor:
        return (tok == _expand(ctx["v1"], tok)) | (tok == _expand(ctx["v2"], tok))

    def accept_prob(self, p_x, q_x, x, ctx):
        return torch.where(ctx["relax"], self._in12(x, ctx).float(), _lossless_accept(p_x, q_x))

    def residual(self, p, q, x, ctx):
        return torch.where(ctx["relax"].unsqueeze(-1), p, lossless_residual(p, q))

    def induced(self, p, q, ctx):
        pair = torch.zeros_like(p, dtype=torch.bool)
        pair.scatter_(-1, ctx["v1"].unsqueeze(-1), True).scatter_(-1, ctx["v2"].unsqueeze(-1), True)
        rejected = q.masked_fill(pair, 0).sum(-1, keepdim=True)  # q mass outside {v1, v2}
        relaxed = q.masked_fill(~pair, 0) + rejected * p
        return torch.where(ctx["relax"].unsqueeze(-1), relaxed, p)

    def chain_stats(self, p, q, ctx):
        return {"q12": q.gather(-1, ctx["v1"].unsqueeze(-1)).squeeze(-1)
                + q.gather(-1, ctx["v2"].unsqueeze(-1)).squeeze(-1)}

    def prob_at(self, p_y, q_y, y, ctx, stats):
        relaxed = torch.where(self._in12(y, ctx), q_y, 0.0) + (1 - stats["q12"]).clamp(min=0) * p_y
        return torch.where(ctx["relax"], relaxed, p_y)

    def induces_target(self, ctx):
        return ~ctx["relax"]

    def node_alpha(self, s_c, p_c, c, ctx):
        return torch.where(ctx["relax"].unsqueeze(-1), self._in12(c, ctx).float(), s_c)

    def node_fallback(self, p, p_rest, ctx):
        return torch.where(ctx["relax"].unsqueeze(-1), p, p_rest)

    def greedy_second(self, logits):
        z1, z2, _, v2 = top2(logits.float())
        return self._relax(z1, z2), v2


@dataclass(frozen=True)
class Overshoot(_RuleBase):
    """Overshoot ceiling: a = min(1, p / (l q)), residual R; P = min(q, p/l) + (1 - beta) R.
    With ``min_p`` set, tokens in A = {p >= min_p max p} are accepted outright (the gate)."""

    lenience: float = 0.5
    min_p: float | None = None
    name: ClassVar[str] = "overshoot"
    full_row_stats: ClassVar[bool] = True

    def __post_init__(self):
        _check_range(self.name, "lenience", self.lenience, 0, 1, True, "(0, 1]")
        if self.min_p is not None:
            _check_range(self.name, "min_p", self.min_p, 0, 1, True, "(0, 1] or None")

    def context(self, z, p):
        return {} if self.min_p is None else {"thr": self.min_p * p.amax(-1)}

    def _gate(self, p_v: Tensor, ctx: Context) -> Tensor | None:
        return None if self.min_p is None else p_v >= _expand(ctx["thr"], p_v)

    def accept_prob(self, p_x, q_x, x, ctx):
        a = (p_x / (self.lenience * q_x)).clamp_(max=1)
        gate = self._gate(p_x, ctx)
        return a if gate is None else a.masked_fill_(gate, 1.0)

    def _accepted_mass(self, p: Tensor, q: Tensor, ctx: Context) -> Tensor:
        g = torch.minimum(q, p / self.lenience)  # q a(x)
        gate = self._gate(p, ctx)
        return g if gate is None else torch.where(gate, q, g)

    def induced(self, p, q, ctx):
        g = self._accepted_mass(p, q, ctx)
        rejected = (q - g).sum(-1, keepdim=True)  # 1 - beta
        r = lossless_residual(p, q)
        return g + rejected * r / r.sum(-1, keepdim=True)

    def chain_stats(self, p, q, ctx):
        over = torch.sub(q, p, alpha=1 / self.lenience).clamp_(min=0)  # (q - p/l)+ = q - g off A
        if self.min_p is not None:
            over.mul_(_below01(p, ctx["thr"]))  # 0 on the gate (p >= thr); over is finite, >= 0
        rejected = over.sum(-1)
        tv = torch.sub(p, q, out=over).clamp_(min=0).sum(-1)  # sum (p - q)+, reusing over's memory
        return {"rejected": rejected, "tv": tv}

    def prob_at(self, p_y, q_y, y, ctx, stats):
        g = self._accepted_mass(p_y, q_y, ctx)
        tv = stats["tv"]
        r = torch.where(tv > 0, (p_y - q_y).clamp(min=0) / tv, p_y)
        return g + stats["rejected"] * r

    def node_alpha(self, s_c, p_c, c, ctx):
        a = (s_c / self.lenience).clamp(max=1)
        gate = self._gate(p_c, ctx)
        return a if gate is None else a.masked_fill(gate, 1.0)


class _TruncationRule(_RuleBase):
    """Accept x iff x in A = {p >= thr}; after rejecting x emit from p without x (chain)."""

    full_row_stats: ClassVar[bool] = True

    def _threshold(self, z: Tensor, p: Tensor) -> Tensor:
        raise NotImplementedError

    def context(self, z, p):
        return {"thr": self._threshold(z, p)}

    def _in_a(self, p_v: Tensor, ctx: Context) -> Tensor:
        return p_v >= _expand(ctx["thr"], p_v)

    def accept_prob(self, p_x, q_x, x, ctx):
        return self._in_a(p_x, ctx).float()

    def residual(self, p, q, x, ctx):
        return p.scatter(-1, x.unsqueeze(-1), 0.0)

    def _outside_terms(self, p: Tensor, q: Tensor, ctx: Context) -> Tensor:
        """q(x) / (1 - p(x)) for x outside A, 0 inside: the rate at which rejected x feed y.
        Written with a float mask (several times faster over a vocabulary row than where).
        1 - p is >= 2^-24 outside A (p < thr <= 1), so flooring it at 1e-30 changes nothing
        there and keeps the quotient finite where p = 1 (inside A), which the mask zeroes."""
        below = _below01(p, ctx["thr"])  # 1 outside A
        denom = torch.rsub(p, 1).clamp_(min=1e-30)
        return torch.div(q, denom, out=denom).mul_(below)

    def induced(self, p, q, ctx):
        t = self._outside_terms(p, q, ctx)
        total = t.sum(-1, keepdim=True)
        return torch.where(self._in_a(p, ctx), q, 0.0) + p * (total - t).clamp_(min=0)

    def chain_stats(self, p, q, ctx):
        return {"feed": self._outside_terms(p, q, ctx).sum(-1)}

    def prob_at(self, p_y, q_y, y, ctx, stats):
        t_y = self._outside_terms(p_y, q_y, ctx)
        return torch.where(self._in_a(p_y, ctx), q_y, 0.0) + p_y * (stats["feed"] - t_y).clamp(min=0)

    def node_alpha(self, s_c, p_c, c, ctx):
        return self._in_a(p_c, ctx).float()


@dataclass(frozen=True)
class Typical(_TruncationRule):
    """Typical acceptance: A = {p >= min(epsilon, delta exp(-H(p)))}."""

    epsilon: float = 0.09
    delta: float = 0.3
    name: ClassVar[str] = "typical"

    def __post_init__(self):
        _check_range(self.name, "epsilon", self.epsilon, 0, 1, True, "(0, 1]")
        _check_range(self.name, "delta", self.delta, 0, 1, True, "(0, 1]")

    def _threshold(self, z, p):
        # log p = z - z1 + log p1, so H = -log p1 - sum p (z - z1) (terms with p = 0 dropped:
        # z = -inf gives -inf * 0 = NaN, which nansum counts as the 0 that nan_to_num would give)
        shifted = (z - z.amax(-1, keepdim=True)).mul_(p)
        entropy = -p.amax(-1).log() - shifted.nansum(-1)  # [...]
        return (self.delta * torch.exp(-entropy)).clamp(max=self.epsilon)


@dataclass(frozen=True)
class MinP(_TruncationRule):
    """SpecCascade-style min-p acceptance: A = {p >= p_base max p}."""

    p_base: float = 0.1
    name: ClassVar[str] = "min_p"

    def __post_init__(self):
        _check_range(self.name, "p_base", self.p_base, 0, 1, True, "(0, 1]")

    def _threshold(self, z, p):
        return self.p_base * p.amax(-1)


@dataclass(frozen=True)
class Cos(_RuleBase):
    """Lossless speculative decoding towards m = lam p + (1 - lam) q: a = min(1, m/q), residual R,
    P = m. Candidate mode (ours): q is one-hot at each candidate, so alpha = 1 - lam (1 - s(c))."""

    lam: float = 0.5
    name: ClassVar[str] = "cos"

    def __post_init__(self):
        _check_range(self.name, "lam", self.lam, 0, 1, False, "[0, 1]")

    def accept_prob(self, p_x, q_x, x, ctx):
        return (self.lam * (p_x / q_x) + (1 - self.lam)).clamp_(max=1)

    def induced(self, p, q, ctx):
        return self.lam * p + (1 - self.lam) * q

    def prob_at(self, p_y, q_y, y, ctx, stats):
        return self.lam * p_y + (1 - self.lam) * q_y

    def induces_target(self, ctx):
        return self.lam == 1

    def node_alpha(self, s_c, p_c, c, ctx):
        # written so that s(c) = 1 gives exactly 1 and lam = 1 gives exactly s(c)
        return s_c if self.lam == 1 else 1 - self.lam * (1 - s_c)


RULES: dict[str, type[_RuleBase]] = {
    cls.name: cls for cls in (Lossless, Mars, Overshoot, Typical, MinP, Cos)
}


def rule_params(name: str) -> list[str]:
    """The parameter names of registered rule ``name``."""
    return [f.name for f in dataclasses.fields(RULES[name])]


def get_rule(name: str, **params: Any) -> VerificationRule:
    """Build the registered rule ``name`` with ``params``; errors list what is allowed."""
    if name not in RULES:
        raise ValueError(f"unknown verification rule {name!r} (valid rules: {', '.join(RULES)})")
    allowed = rule_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"rule {name!r} has no parameter {unknown[0]!r} "
                         f"(its parameters: {', '.join(allowed) or 'none'})")
    return RULES[name](**params)
