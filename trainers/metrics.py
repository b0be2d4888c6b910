"""Drift and importance-sampling metrics, logged every training step.

Vocabulary (all over the valid tokens of a batch, [N, T] with a bool mask):
- **log ratio** log r = log pi(y) - log P(y), policy over behaviour, per sampled token.
- **KL(P || pi) estimates** from tokens sampled from P: k1 = mean(-log r) (unbiased, can be
  negative), k3 = mean(r - 1 - log r) (unbiased, >= 0; Schulman's estimator).
- **IS weight stats**: min/mean/max over the kept tokens; **masked fraction**: valid tokens
  that the correction dropped (weight 0).
- **effective sample size** (normalised to [0, 1]): ESS = (sum w)^2 / (M sum w^2) over the M
  valid tokens (dropped tokens count with w = 0). 1 when all weights are equal.
- **relaxed fraction**: valid tokens emitted by a relaxed (lossy) acceptance, e.g. a MARS
  relaxation, from a bool ``relaxed`` mask the rollout provides.
Statistics are computed in float64 and returned as Python floats.
"""

from __future__ import annotations

import torch


def _valid_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape != mask.shape:
        raise ValueError(f"values {tuple(x.shape)} and mask {tuple(mask.shape)} differ in shape")
    return x.detach().double()[mask.bool()]


def effective_sample_size(weights: torch.Tensor) -> float:
    """(sum w)^2 / (M sum w^2) for M weights >= 0, in [0, 1]; 0.0 if all are 0, 1.0 if M = 0."""
    w = weights.detach().double().flatten()
    if w.numel() == 0:
        return 1.0
    if (w < 0).any():
        raise ValueError("importance weights must be >= 0")
    sq = (w * w).sum()
    if sq == 0:
        return 0.0
    return float(w.sum() ** 2 / (w.numel() * sq))


def weight_stats(weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """IS weight min/mean/max over kept tokens, ESS over valid tokens, masked fraction."""
    w_valid = _valid_values(weights, mask)
    w_kept = _valid_values(weights, keep.bool() & mask.bool())
    n_valid = w_valid.numel()
    return {
        "is_weight_min": float(w_kept.min()) if w_kept.numel() else 0.0,
        "is_weight_mean": float(w_kept.mean()) if w_kept.numel() else 0.0,
        "is_weight_max": float(w_kept.max()) if w_kept.numel() else 0.0,
        "is_ess": effective_sample_size(w_valid),
        "is_masked_frac": 1.0 - w_kept.numel() / n_valid if n_valid else 0.0,
    }


def drift_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean/abs-mean/max-abs log ratio (policy over behaviour) and KL(P || pi) as k1 and k3."""
    lr = _valid_values(log_ratio, mask)
    if lr.numel() == 0:
        return {"log_ratio_mean": 0.0, "log_ratio_abs_mean": 0.0, "log_ratio_abs_max": 0.0,
                "kl_k1": 0.0, "kl_k3": 0.0}
    # r - 1 - log r via expm1 keeps precision near r = 1; clamp only guards float64 overflow
    k3 = torch.expm1(lr.clamp(max=700.0)) - lr
    return {
        "log_ratio_mean": float(lr.mean()),
        "log_ratio_abs_mean": float(lr.abs().mean()),
        "log_ratio_abs_max": float(lr.abs().max()),
        "kl_k1": float(-lr.mean()),
        "kl_k3": float(k3.mean()),
    }


def relaxed_fraction(relaxed: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of valid tokens that were emitted by a relaxed (lossy) acceptance."""
    r = _valid_values(relaxed.to(torch.bool), mask)
    return float(r.mean()) if r.numel() else 0.0


def reward_stats(rewards: torch.Tensor, correct: torch.Tensor | None = None) -> dict[str, float]:
    """Reward mean/std/min/max, accuracy and the share of groups that carry no signal.

    rewards [B, G] (or flat, then group stats are skipped); correct: bool like rewards,
    default rewards >= 1 (the exact-match reward plus any format bonus).
    """
    r = rewards.detach().double()
    if r.numel() == 0:
        raise ValueError("reward_stats needs at least one reward")
    ok = (r >= 1.0) if correct is None else correct.detach().to(torch.bool)
    if ok.shape != r.shape:
        raise ValueError(f"correct {tuple(ok.shape)} must match rewards {tuple(r.shape)}")
    out = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_min": float(r.min()),
        "reward_max": float(r.max()),
        "accuracy": float(ok.double().mean()),
    }
    if r.dim() == 2:
        flat = (r.max(dim=1).values == r.min(dim=1).values).double()  # [B]
        out["groups_zero_std_frac"] = float(flat.mean())
        out["groups_any_correct_frac"] = float(ok.any(dim=1).double().mean())
    return out
