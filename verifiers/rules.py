"""The registered verification rules: each class holds one rule's procedure, its closed forms
and its kernel declaration (``kernel_id``, ``kernel_args``: the case of verifiers/csrc/rules.h
that implements it, with its arguments). The interface and the registry are in
:mod:`verifiers.rule_base`; verifiers/README.md has the math (the chain and candidate tables).
Also here: :class:`TruncationSampling`, the truncation rules' matched baseline (not registered).

Greedy (T = 0): every rule accepts x iff x is the target argmax v1, except MARS, which also
accepts v2 when its ratio test on the raw logits holds (``greedy_second``). The cos rule has no
deterministic form of its own, so at T = 0 it is greedy like the others (our choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .processing import top2
from .rule_base import (RULES, Context, RuleBase, VerificationRule, below01, check_range, expand,
                        get_rule, lossless_accept, lossless_residual, register, rule_params)

__all__ = ["RULES", "Context", "VerificationRule", "get_rule", "register", "rule_params", "lossless_residual",
           "Lossless", "Mars", "Overshoot", "Typical", "MinP", "Cos", "TruncationSampling"]


@register
@dataclass(frozen=True)
class Lossless(RuleBase):
    """Standard speculative sampling: a = min(1, p/q), residual norm((p - q)+), P = p."""

    name: ClassVar[str] = "lossless"
    kernel_id: ClassVar[int] = 0

    def induced(self, p, q, ctx):
        return p

    def prob_at(self, p_y, q_y, y, ctx, stats):
        return p_y

    def induces_target(self, ctx):
        return True


@register
@dataclass(frozen=True)
class Mars(RuleBase):
    """MARS: where z1 > 0 and z2/z1 > theta (top-2 processed logits), accept v1 and v2 outright
    and fall back to p itself; elsewhere exactly lossless. The z1 > 0 guard is ours."""

    theta: float = 0.9
    name: ClassVar[str] = "mars"
    kernel_id: ClassVar[int] = 1

    def kernel_args(self):
        return (self.theta,)

    def __post_init__(self):
        check_range(self.name, "theta", self.theta, 0, 1, False, "[0, 1]")

    def _relax(self, z1: Tensor, z2: Tensor) -> Tensor:
        return (z1 > 0) & (z2 / z1 > self.theta)

    def context(self, z, p):
        z1, z2, v1, v2 = top2(z)
        return {"relax": self._relax(z1, z2), "v1": v1, "v2": v2}

    def _in12(self, tok: Tensor, ctx: Context) -> Tensor:
        return (tok == expand(ctx["v1"], tok)) | (tok == expand(ctx["v2"], tok))

    def accept_prob(self, p_x, q_x, x, ctx):
        return torch.where(ctx["relax"], self._in12(x, ctx).float(), lossless_accept(p_x, q_x))

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


@register
@dataclass(frozen=True)
class Overshoot(RuleBase):
    """Overshoot ceiling: a = min(1, p / (l q)), residual R; P = min(q, p/l) + (1 - beta) R.
    With ``min_p`` set, tokens in A = {p >= min_p max p} are accepted outright (the gate)."""

    lenience: float = 0.5
    min_p: float | None = None
    name: ClassVar[str] = "overshoot"
    full_row_stats: ClassVar[bool] = True
    kernel_id: ClassVar[int] = 2

    def kernel_args(self):
        return (self.lenience, self.min_p or 0.0)  # 0: no gate

    def __post_init__(self):
        check_range(self.name, "lenience", self.lenience, 0, 1, True, "(0, 1]")
        if self.min_p is not None:
            check_range(self.name, "min_p", self.min_p, 0, 1, True, "(0, 1] or None")

    def context(self, z, p):
        return {} if self.min_p is None else {"thr": self.min_p * p.amax(-1)}

    def _gate(self, p_v: Tensor, ctx: Context) -> Tensor | None:
        return None if self.min_p is None else p_v >= expand(ctx["thr"], p_v)

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
            over.mul_(below01(p, ctx["thr"]))  # 0 on the gate (p >= thr); over is finite, >= 0
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


class TruncationRule(RuleBase):
    """Accept x iff x in A = {p >= thr}; after rejecting x emit from p without x (chain)."""

    full_row_stats: ClassVar[bool] = True

    def _threshold(self, z: Tensor, p: Tensor) -> Tensor:
        raise NotImplementedError

    def context(self, z, p):
        return {"thr": self._threshold(z, p)}

    def _in_a(self, p_v: Tensor, ctx: Context) -> Tensor:
        return p_v >= expand(ctx["thr"], p_v)

    def accept_prob(self, p_x, q_x, x, ctx):
        return self._in_a(p_x, ctx).float()

    def residual(self, p, q, x, ctx):
        return p.scatter(-1, x.unsqueeze(-1), 0.0)

    def _outside_terms(self, p: Tensor, q: Tensor, ctx: Context) -> Tensor:
        """q(x) / (1 - p(x)) for x outside A, 0 inside: the rate at which rejected x feed y.
        Written with a float mask (several times faster over a vocabulary row than where).
        1 - p is >= 2^-24 outside A (p < thr <= 1), so flooring it at 1e-30 changes nothing
        there and keeps the quotient finite where p = 1 (inside A), which the mask zeroes."""
        below = below01(p, ctx["thr"])  # 1 outside A
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


@register
@dataclass(frozen=True)
class Typical(TruncationRule):
    """Typical acceptance: A = {p >= min(epsilon, delta exp(-H(p)))}."""

    epsilon: float = 0.09
    delta: float = 0.3
    name: ClassVar[str] = "typical"
    kernel_id: ClassVar[int] = 3

    def kernel_args(self):
        return (self.epsilon, self.delta)

    def __post_init__(self):
        check_range(self.name, "epsilon", self.epsilon, 0, 1, True, "(0, 1]")
        check_range(self.name, "delta", self.delta, 0, 1, True, "(0, 1]")

    def _threshold(self, z, p):
        # log p = z - z1 + log p1, so H = -log p1 - sum p (z - z1) (terms with p = 0 dropped:
        # z = -inf gives -inf * 0 = NaN, which nansum counts as the 0 that nan_to_num would give)
        shifted = (z - z.amax(-1, keepdim=True)).mul_(p)
        entropy = -p.amax(-1).log() - shifted.nansum(-1)  # [...]
        return (self.delta * torch.exp(-entropy)).clamp(max=self.epsilon)


@register
@dataclass(frozen=True)
class MinP(TruncationRule):
    """SpecCascade-style min-p acceptance: A = {p >= p_base max p}."""

    p_base: float = 0.1
    name: ClassVar[str] = "min_p"
    kernel_id: ClassVar[int] = 4

    def kernel_args(self):
        return (self.p_base,)

    def __post_init__(self):
        check_range(self.name, "p_base", self.p_base, 0, 1, True, "(0, 1]")

    def _threshold(self, z, p):
        return self.p_base * p.amax(-1)


@register
@dataclass(frozen=True)
class Cos(RuleBase):
    """Lossless speculative decoding towards m = lam p + (1 - lam) q: a = min(1, m/q), residual R,
    P = m. Candidate mode (ours): q is one-hot at each candidate, so alpha = 1 - lam (1 - s(c))."""

    lam: float = 0.5
    name: ClassVar[str] = "cos"
    kernel_id: ClassVar[int] = 5

    def kernel_args(self):
        return (self.lam,)

    def __post_init__(self):
        check_range(self.name, "lam", self.lam, 0, 1, False, "[0, 1]")

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




@dataclass(frozen=True)
class TruncationSampling(RuleBase):
    """Sampling from p restricted to a truncation rule's set A = {p >= thr}: the matched baseline
    of typical and min_p (compare them with it, not with plain sampling). Written as a rule that
    never accepts a candidate and whose fallback and residual are p on A, so it runs through the
    engine like any verifier (with speculation off, P = p_A / p(A) at every position) and its
    behaviour log-probs come out exact. Not registered: it is built around a truncation rule,
    ``TruncationSampling(get_rule("min_p", p_base=0.2))``; it has no kernel (PyTorch path)."""

    base: TruncationRule

    def __post_init__(self):
        if not isinstance(self.base, TruncationRule):
            raise TypeError(f"TruncationSampling needs a truncation rule (typical, min_p), got {self.base!r}")

    @property
    def name(self) -> str:
        return f"sampling[{self.base.name}]"

    def context(self, z, p):
        return self.base.context(z, p)

    def _keep(self, p: Tensor, ctx: Context) -> Tensor:  # p on A, 0 elsewhere [..., V]
        return torch.where(p >= expand(ctx["thr"], p), p, 0.0)

    def accept_prob(self, p_x, q_x, x, ctx):
        return torch.zeros_like(p_x)

    def residual(self, p, q, x, ctx):
        return self._keep(p, ctx)

    def induced(self, p, q, ctx):
        kept = self._keep(p, ctx)
        return kept / kept.sum(-1, keepdim=True)

    def chain_stats(self, p, q, ctx):
        return {"mass": self._keep(p, ctx).sum(-1)}

    def prob_at(self, p_y, q_y, y, ctx, stats):
        return self._keep(p_y, ctx) / stats["mass"]

    def node_alpha(self, s_c, p_c, c, ctx):
        return torch.zeros_like(s_c)

    def node_fallback(self, p, p_rest, ctx):
        return self._keep(p, ctx)
