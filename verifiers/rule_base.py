"""What every verification rule shares: the interface, the base class, the lossless pieces that
rules reuse explicitly, and the registry (:data:`RULES`, :func:`register`, :func:`get_rule`).

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

Greedy (T = 0): every rule accepts x iff x is the target argmax v1, unless ``greedy_second``
names a second accepted token (MARS).

The fused C++ kernel: a rule whose class sets ``kernel_id`` runs there, with the arguments
``kernel_args`` returns (the order verifiers/csrc/rules.h reads them); without one it runs on
the PyTorch path. verifiers/README.md is the math contract.

All methods are batched over leading dims; the rules are frozen dataclasses, built by name
with :func:`get_rule`.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

Context = dict[str, Tensor]


@runtime_checkable
class VerificationRule(Protocol):
    """The interface every rule implements (see the module docstring)."""

    name: str
    kernel_id: int | None

    def kernel_args(self) -> tuple[float, ...]: ...
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


def lossless_accept(p_x: Tensor, q_x: Tensor) -> Tensor:
    """a(x) = min(1, p(x) / q(x))."""
    return (p_x / q_x).clamp_(max=1)


def lossless_residual(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalised R = (p - q)+ [..., V]; p itself on rows where p <= q everywhere (TV = 0 guard)."""
    w = (p - q).clamp_(min=0)
    empty = w.sum(-1, keepdim=True) <= 0  # [..., 1]
    return torch.where(empty, p, w) if bool(empty.any()) else w


def expand(t: Tensor, like: Tensor) -> Tensor:
    """A per-row value [...] broadcast against [..., n] when ``like`` has one more dim."""
    return t.unsqueeze(-1) if like.dim() > t.dim() else t


def below01(p: Tensor, thr: Tensor) -> Tensor:
    """(p < thr) as float32 ones and zeros [..., V] (thr [...]): written as float directly, which is
    several times faster over a vocabulary row on the CPU than a bool mask and where/masked_fill.
    Multiplying a finite x >= 0 by it equals ``torch.where(p >= thr, 0.0, x)`` exactly."""
    return torch.lt(p, expand(thr, p), out=torch.empty_like(p))


def check_range(rule: str, param: str, value: Any, low: float, high: float,
                low_open: bool, text: str) -> None:
    """Raise ValueError naming the rule, the parameter and ``text`` unless value is a finite number in range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise ValueError(f"rule {rule!r}: parameter {param!r} must be in {text}, got {value!r}")


class RuleBase(abc.ABC):
    """The base of every rule. The closed forms ``induced`` and ``prob_at`` (where behaviour
    log-probs come from) have no default: each rule writes its own, and a class without them
    can be neither built nor registered. The procedure's steps default to the lossless ones
    (accept min(1, p/q), residual (p - q)+, alpha = s(c), fallback p without the candidates);
    the tests check every registered rule's closed forms against enumerating that procedure."""

    name: ClassVar[str]
    # chain_stats reduces whole vocabulary rows (worth computing only at the positions read)
    full_row_stats: ClassVar[bool] = False
    # the rule's id in the fused kernel (verifiers/csrc/rules.h); None: it runs on PyTorch
    kernel_id: ClassVar[int | None] = None

    def kernel_args(self) -> tuple[float, ...]:
        """The kernel's arguments for this rule, in the order csrc/rules.h reads them."""
        return ()

    def context(self, z: Tensor, p: Tensor) -> Context:
        return {}

    def accept_prob(self, p_x, q_x, x, ctx):
        return lossless_accept(p_x, q_x)

    def residual(self, p, q, x, ctx):
        return lossless_residual(p, q)

    @abc.abstractmethod
    def induced(self, p: Tensor, q: Tensor, ctx: Context) -> Tensor:
        """The closed form P [..., V] of chain verification."""

    def chain_stats(self, p, q, ctx):
        return {}

    @abc.abstractmethod
    def prob_at(self, p_y: Tensor, q_y: Tensor, y: Tensor, ctx: Context, stats: dict[str, Tensor]) -> Tensor:
        """P(y) from values gathered at y and the row statistics of ``chain_stats``."""

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


RULES: dict[str, type[RuleBase]] = {}


def register(cls: type[RuleBase]) -> type[RuleBase]:
    """Add rule class ``cls`` to :data:`RULES` under ``cls.name`` (a class decorator). Raises
    TypeError unless it is a frozen dataclass deriving :class:`RuleBase` that defines its closed
    forms, with a name and a kernel id no registered rule has."""
    if not (inspect.isclass(cls) and issubclass(cls, RuleBase)):
        raise TypeError(f"a registered rule must derive verifiers.rule_base.RuleBase, got {cls!r}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"rule class {cls.__name__} does not define {missing}: every rule writes its own "
                        "closed form (share the lossless one explicitly where the math is the same)")
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"rule class {cls.__name__} must be a frozen dataclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or name in RULES:
        raise TypeError(f"rule class {cls.__name__} needs a name no registered rule has, got {name!r}")
    taken = {other.kernel_id: other.name for other in RULES.values() if other.kernel_id is not None}
    if cls.kernel_id is not None and cls.kernel_id in taken:
        raise TypeError(f"rule {name!r}: kernel id {cls.kernel_id} is already rule {taken[cls.kernel_id]!r}'s")
    RULES[name] = cls
    return cls


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
