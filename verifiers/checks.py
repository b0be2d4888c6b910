"""Entry checks for the verification functions: shapes, dtypes, token ranges, generators,
and the error raised for a NaN / +inf / all -inf logit row (naming the tensor, row, position).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .processing import check_sampling
from .rule_base import RuleBase, VerificationRule


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def check_rule(rule: object) -> None:
    # the registered rules first: a runtime Protocol check costs several microseconds
    if not isinstance(rule, RuleBase) and not isinstance(rule, VerificationRule):
        raise TypeError(f"rule must be a verification rule from get_rule(...), got {type(rule).__name__}")


def _check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")


def _check_long(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dtype not in (torch.long, torch.int32):
        raise ValueError(f"{name} must be an integer (long) tensor, got {getattr(t, 'dtype', type(t))}")


def check_generator(generator: torch.Generator | None, temperature: float, device: torch.device) -> None:
    """T > 0 needs an explicit generator on the logits' device (randomness is an input)."""
    if temperature == 0:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError("temperature > 0 needs an explicit torch.Generator (generator=...)")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the logits are on {device}")


def check_token_range(name: str, tokens: Tensor, vocab: int, allow_pad: bool) -> None:
    """Every id in [0, vocab) (or -1 where padding is allowed)."""
    if tokens.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(tokens))
    low = -1 if allow_pad else 0
    if lo < low or hi >= vocab:
        bad = ((tokens < low) | (tokens >= vocab)).nonzero()[0].tolist()
        raise ValueError(f"{name}{bad} = {int(tokens[tuple(bad)])} is outside the vocabulary "
                         f"[0, {vocab})" + (" (or -1 for padding)" if allow_pad else ""))


def _check_rule_and_target(rule, target_logits: Tensor, layout: str, temperature: float, top_k, top_p) -> None:
    """The rule, the sampling parameters and target_logits' dtype and layout ('[B, K+1, V]' or
    '[N, V]': that many dims, at least one entry along the second)."""
    check_rule(rule)
    check_sampling(temperature, top_k, top_p)
    _check_float("target_logits", target_logits)
    if target_logits.dim() != layout.count(",") + 1 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be {layout}, got shape {_shape(target_logits)}")


def check_chain_inputs(rule, target_logits: Tensor, draft_logits: Tensor, draft_tokens: Tensor,
                       temperature: float, top_k, top_p, contents: bool = True) -> tuple[int, int, int]:
    """Validate verify_chain's inputs; returns (B, K, V). ``contents=False`` skips the token
    range check (the C++ verifier checks it and the caller then re-runs this to raise)."""
    _check_rule_and_target(rule, target_logits, "[B, K+1, V]", temperature, top_k, top_p)
    _check_float("draft_logits", draft_logits)
    _check_long("draft_tokens", draft_tokens)
    b, k1, v = target_logits.shape
    if v < 1:
        raise ValueError(f"target_logits has an empty vocabulary: shape {_shape(target_logits)}")
    if tuple(draft_logits.shape) != (b, k1 - 1, v):
        raise ValueError(f"draft_logits shape {_shape(draft_logits)} does not match target_logits "
                         f"shape {_shape(target_logits)} (expected [{b}, {k1 - 1}, {v}])")
    if tuple(draft_tokens.shape) != (b, k1 - 1):
        raise ValueError(f"draft_tokens shape {_shape(draft_tokens)} does not match target_logits "
                         f"shape {_shape(target_logits)} (expected [{b}, {k1 - 1}])")
    for name, t in (("draft_logits", draft_logits), ("draft_tokens", draft_tokens)):
        if t.device != target_logits.device:
            raise ValueError(f"{name} is on {t.device} but target_logits is on {target_logits.device}")
    if contents:
        check_token_range("draft_tokens", draft_tokens, v, allow_pad=False)
    return b, k1 - 1, v


def check_pair_inputs(rule, target_logits: Tensor, draft_logits: Tensor, temperature: float,
                      top_k, top_p) -> tuple[int, int]:
    """Validate induced_chain's inputs (both [N, V]); returns (N, V)."""
    _check_rule_and_target(rule, target_logits, "[N, V]", temperature, top_k, top_p)
    _check_float("draft_logits", draft_logits)
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft_logits shape {_shape(draft_logits)} does not match target_logits "
                         f"shape {_shape(target_logits)}")
    return tuple(target_logits.shape)


def check_candidate_inputs(rule, target_logits: Tensor, candidates: Tensor, temperature: float,
                           top_k, top_p, contents: bool = True) -> tuple[int, int, int]:
    """Validate verify_candidates' inputs; returns (N, m, V). Candidates: distinct ids, -1
    padding only after the valid ones (``contents=False`` skips these value checks: the C++
    verifier makes them and the caller then re-runs this to raise)."""
    _check_rule_and_target(rule, target_logits, "[N, V]", temperature, top_k, top_p)
    _check_long("candidates", candidates)
    n, v = target_logits.shape
    if candidates.dim() != 2 or candidates.shape[0] != n:
        raise ValueError(f"candidates shape {_shape(candidates)} does not match target_logits "
                         f"shape {_shape(target_logits)} (expected [{n}, m])")
    if candidates.device != target_logits.device:
        raise ValueError(f"candidates is on {candidates.device} but target_logits is on {target_logits.device}")
    if not contents:
        return n, candidates.shape[1], v
    check_token_range("candidates", candidates, v, allow_pad=True)
    valid = candidates >= 0
    if candidates.shape[1] > 1 and n > 0:
        if (valid[:, 1:] & ~valid[:, :-1]).any():
            row = int((valid[:, 1:] & ~valid[:, :-1]).any(-1).nonzero()[0])
            raise ValueError(f"candidates row {row}: -1 padding must come after the valid candidates")
        ordered = candidates.sort(-1).values
        dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if dup.any():
            row = int(dup.any(-1).nonzero()[0])
            raise ValueError(f"candidates row {row} repeats a token: candidates must be distinct")
    return n, candidates.shape[1], v


def raise_if_bad_rows(name: str, raw: Tensor, row_stat: Tensor, temperature: float | None = None) -> None:
    """Raise ValueError naming ``name`` and the (row, position) of the first non-finite entry of
    row_stat (a row max or log-normaliser of raw [..., V]): a NaN, a +inf, an all -inf row, or
    finite logits that overflow float32 once divided by the temperature."""
    bad = (~torch.isfinite(row_stat)).nonzero()
    if len(bad) == 0:
        return
    index = tuple(int(i) for i in bad[0])
    row = raw[index].float()
    if torch.isnan(row).any():
        what = "contains NaN"
    elif torch.isposinf(row).any():
        what = "contains +inf"
    elif torch.isfinite(row).any():
        t = "" if temperature is None else f" T = {temperature:g}"
        what = (f"is finite (largest |logit| {float(row[torch.isfinite(row)].abs().max()):.3g}) but overflows "
                f"float32 once divided by the temperature{t}")
    else:
        what = "is all -inf (no token has positive probability)"
    where = ", ".join(f"{axis} {i}" for axis, i in zip(("row", "position"), index))
    raise ValueError(f"{name}: the logit vector at {where} {what}")


def zero_q_draft_error(x: Tensor, b: int, j: int) -> ValueError:
    """The error for chain draft ``x[b, j]`` that q gives probability 0."""
    return ValueError(f"draft_tokens[{b}, {j}] = {int(x[b, j])} has zero probability under the draft "
                      "distribution q (chain drafts must be sampled from q at the same temperature; "
                      "use verify_candidates for deterministic drafts)")
