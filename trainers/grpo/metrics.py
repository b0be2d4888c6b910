"""Training-only metrics of a GRPO step: rewards per group and the relaxed fraction.

- **relaxed fraction**: valid tokens emitted by a relaxed (lossy) acceptance, e.g. a MARS
  relaxation, from a bool ``relaxed`` mask the rollout provides.
- **reward stats**: mean/std/min/max of the rewards, the accuracy, and per group of G
  completions whether it carries no signal (all rewards equal) or any correct answer.
The drift and importance-weight statistics of the log are ``trainers.drift.stats``.
"""

from __future__ import annotations

import torch

from trainers.drift.stats import valid_values


def relaxed_fraction(relaxed: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of valid tokens that were emitted by a relaxed (lossy) acceptance."""
    r = valid_values(relaxed.to(torch.bool), mask)
    return float(r.mean()) if r.numel() else 0.0


def reward_stats(rewards: torch.Tensor, correct: torch.Tensor | None = None) -> dict[str, float]:
    """Reward mean/std/min/max, accuracy and the share of groups that carry no signal.

    ``reward_std`` describes the step's rewards as a population (all B x G of them, divisor B x G);
    the advantages scale by each group's unbiased std instead (``trainers.grpo.loss``).

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
