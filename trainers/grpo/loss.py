"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Vocabulary:
- **group**: the G completions sampled for one prompt; rewards come as [B, G] (or flat
  [B*G], prompt-major).
- **advantage**: a completion's reward minus its group's mean, optionally divided by the
  group's standard deviation (``scale_std``; unbiased std, as in DeepSeekMath/TRL). A group
  of identical rewards has advantage 0 (no NaN); a group of one has advantage 0.
- **logp_new**: log-probs of the rollout tokens under the policy being optimised (with
  grad); **logp_old**: the same under the policy at the start of the step (no grad; the
  trainer's recomputation, not the rollout engine's numbers); **ratio** = exp(logp_new -
  logp_old), which the clipped objective keeps within [1 - clip_low, 1 + clip_high].
- **is_weights**: the off-policy correction pi_old(y) / P(y) for the behaviour distribution
  P the rollout really sampled from (see ``trainers.grpo.correction``); a detached factor on each
  token's clipped term.
- **aggregation**: "token" = sum over every valid token / number of valid tokens;
  "sequence" = mean over sequences (those with at least one valid token) of each
  sequence's token mean.
- **k3 KL**: exp(ref - new) - (ref - new) - 1 per token, an unbiased, non-negative
  estimate of KL(pi || ref) on tokens sampled from pi, added with weight ``kl_coef``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.config import ConfigError, check_int, check_number

AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 4  # completions per prompt (G)
    clip_low: float = 0.2  # ratio floor is 1 - clip_low; in [0, 1)
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO's clip-higher: 0.28)
    aggregation: str = "token"  # "token" | "sequence", see the module docstring
    scale_std: bool = True  # divide advantages by the group's reward std
    std_eps: float = 1e-6  # added to the std before dividing
    kl_coef: float = 0.0  # weight of the k3 KL to the reference policy; 0 disables it

    def __post_init__(self):
        check_int("group_size", self.group_size)
        if self.group_size < 2:
            raise ConfigError("group_size", f"must be >= 2, got {self.group_size}: a group of one sample has "
                              "advantage 0 (its own mean), so nothing would be learned")
        check_number("clip_low", self.clip_low, 0.0, 1.0, high_open=True)
        check_number("clip_high", self.clip_high, 0.0, float("inf"))
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError("aggregation", f"unknown value {self.aggregation!r}", allowed=AGGREGATIONS)
        if not isinstance(self.scale_std, bool):
            raise ConfigError("scale_std", f"must be true or false, got {self.scale_std!r}")
        check_number("std_eps", self.std_eps, 0.0, float("inf"), low_open=True)
        check_number("kl_coef", self.kl_coef, 0.0, float("inf"))

    def loss_kwargs(self) -> dict:
        """The keyword arguments of ``policy_loss`` that this config fixes."""
        return dict(clip_low=self.clip_low, clip_high=self.clip_high,
                    aggregation=self.aggregation, kl_coef=self.kl_coef)


def group_advantages(rewards: torch.Tensor, group_size: int | None = None, *,
                     scale_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages [B, G] from rewards [B, G], or [B*G] with ``group_size``."""
    if rewards.dim() == 1:
        if group_size is None or group_size <= 0 or rewards.numel() % group_size:
            raise ValueError(f"flat rewards of length {rewards.numel()} need a group_size "
                             f"that divides it, got {group_size}")
        rewards = rewards.view(-1, group_size)  # [B, G]
    elif rewards.dim() != 2 or (group_size is not None and rewards.shape[1] != group_size):
        raise ValueError(f"rewards must be [B, G] or [B*G], got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [B, G]
    if not scale_std:
        return centred
    if rewards.shape[1] < 2:
        return torch.zeros_like(centred)
    std = rewards.std(dim=1, keepdim=True)  # [B, 1], unbiased
    return centred / (std + eps)


def _aggregate(per_token: torch.Tensor, valid: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Token or sequence mean of per_token [N, T] over the valid tokens (padding may hold anything)."""
    per_token = torch.where(valid, per_token, 0.0)
    maskf = valid.to(per_token.dtype)
    if aggregation == "token":
        return per_token.sum() / maskf.sum().clamp(min=1.0)
    counts = maskf.sum(dim=1)  # [N]
    seq_means = per_token.sum(dim=1) / counts.clamp(min=1.0)  # [N]
    has_tokens = (counts > 0).to(per_token.dtype)
    return (seq_means * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def _check_inputs(logp_new, logp_old, advantages, mask, is_weights, ref_logp, aggregation):
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [N, T], got {tuple(logp_new.shape)}")
    for name, t in (("logp_old", logp_old), ("mask", mask), ("is_weights", is_weights),
                    ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp_new.shape:
            raise ValueError(f"{name} must match logp_new {tuple(logp_new.shape)}, got {tuple(t.shape)}")
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{logp_new.shape[0]}], got {tuple(advantages.shape)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                aggregation: str = "token", is_weights: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO/PPO clipped surrogate loss (to minimise) and its stats.

    Per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * w + kl_coef * k3,
    with r = exp(logp_new - logp_old) and w = is_weights (detached; 1 when None).
    Shapes: logp_new, logp_old, mask, is_weights, ref_logp [N, T]; advantages [N].
    A valid token with logp_old = -inf (outside the policy's top-p/top-k support,
    ``trainers.grpo.correction``) has no ratio: its term is 0 (it stays in the denominator,
    as a masked token does).
    """
    _check_inputs(logp_new, logp_old, advantages, mask, is_weights, ref_logp, aggregation)
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    valid = mask.bool()  # [N, T]
    scored = valid & (logp_old != float("-inf"))  # the tokens with a ratio
    log_ratio = torch.where(scored, logp_new - logp_old.detach(), 0.0)  # padding: no overflow, no NaN
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = advantages.detach().to(logp_new.dtype).unsqueeze(1)  # [N, 1]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.where(scored, torch.maximum(unclipped, clipped), 0.0)  # [N, T]
    if is_weights is not None:
        pg = pg * is_weights.detach().to(pg.dtype)
    per_token = pg
    kl = None
    if ref_logp is not None and kl_coef > 0:
        delta = torch.where(scored, ref_logp.detach() - logp_new, 0.0)
        kl = torch.exp(delta) - delta - 1.0  # [N, T], k3 >= 0
        per_token = per_token + kl_coef * kl
    loss = _aggregate(per_token, valid, aggregation)
    with torch.no_grad():
        n = max(int(valid.sum()), 1)
        stats = {
            "loss": loss.item(),
            "pg_loss": _aggregate(pg, valid, aggregation).item(),
            "clip_frac": ((clipped > unclipped) & scored).sum().item() / n,
            "ratio_mean": ratio[scored].sum().item() / max(int(scored.sum()), 1),
            "ratio_min": ratio[scored].min().item() if scored.any() else 1.0,
            "ratio_max": ratio[scored].max().item() if scored.any() else 1.0,
            "kl_ref": _aggregate(kl, valid, aggregation).item() if kl is not None else 0.0,
        }
    return loss, stats
