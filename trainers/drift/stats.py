"""Drift and importance-sampling statistics, written once: the GRPO training log
(``trainers.grpo.correction``), the TRL trainer's ``speculative/*`` metrics, the drift
study's report and a training run's per-step view (``trainers.drift.report``) all use them.

Vocabulary (over the valid tokens of a batch, [N, T] with a bool mask, or a flat sample):
- **log ratio** log r = log pi(y) - log P(y), a distribution over the behaviour P, per
  token y sampled from P (pi: the trainer's policy, or the rollout's target p).
- **KL(P || pi) estimates** from tokens sampled from P: k1 = mean(-log r) (can be negative)
  and k3 = mean(r - 1 - log r) (>= 0; Schulman's estimator). E_P[r] = 1 - m, with m pi's mass
  on {P = 0} (the uncovered mass), so E_P[k1] = KL(P || pi) but E_P[k3] = KL(P || pi) - m:
  k3 is unbiased only where pi has no mass outside P's support. m > 0 wherever a lossy rule
  emits a deterministic candidate outright (P a point mass at a top-k tree node or a greedy
  draft: MARS relaxing, overshoot with p(c) >= lenience, min-p or typical with c in their
  set), where k3 under-reports the drift (by about half for MARS theta 0.9 on top-4 trees of
  synthetic logits); reports show k1 next to it.
- **IS weight stats**: min/mean/max over the kept tokens; **masked fraction**: valid tokens
  that the correction dropped (weight 0).
- **effective sample size** (normalised to [0, 1]): ESS = (sum w)^2 / (M sum w^2) over M
  weights (dropped tokens count with w = 0); 1 when all weights are equal. The **sequence
  ESS** is the same over the weights exp(log w) of whole sequences, computed stably.
- **Wilson interval**: the 95% score interval of an accuracy k / n. **gap**: accuracy of a
  configuration minus that of its baseline, with Newcombe's hybrid score interval (from
  the two Wilson intervals) and a pooled two-proportion z-test (unpaired, so conservative
  when both runs use the same prompts).
Statistics are computed in float64 and returned as Python floats.
"""

from __future__ import annotations

import math

import torch

Z95 = 1.959963984540054


# ----------------------------------------------------------------------------- samples and weights
def valid_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entries of ``x`` where ``mask`` holds, detached, as a flat float64 tensor."""
    if x.shape != mask.shape:
        raise ValueError(f"values {tuple(x.shape)} and mask {tuple(mask.shape)} differ in shape")
    return x.detach().double()[mask.bool()]


def kl_estimates(log_r: torch.Tensor) -> tuple[float, float]:
    """(k1, k3) estimates of KL(P || .) from float64 log r = log(. / P) at samples of P; (0, 0) when
    empty. k1 is unbiased; k3's mean is KL minus the mass of . outside P's support (see above)."""
    if log_r.numel() == 0:
        return 0.0, 0.0
    # r - 1 - log r via expm1 keeps precision near r = 1; clamp only guards float64 overflow
    k3 = torch.expm1(log_r.clamp(max=700.0)) - log_r
    return float(-log_r.mean()), float(k3.mean())


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


def sequence_ess(log_w: torch.Tensor) -> float:
    """The effective sample size of weights exp(log_w) [n], scaled by the largest first; 1.0 when empty."""
    if log_w.numel() == 0:
        return 1.0
    return min(1.0, effective_sample_size(torch.exp(log_w.double() - log_w.max())))


def weight_stats(weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """IS weight min/mean/max over kept tokens, ESS over valid tokens, masked fraction."""
    w_valid = valid_values(weights, mask)
    w_kept = valid_values(weights, keep.bool() & mask.bool())
    n_valid = w_valid.numel()
    return {
        "is_weight_min": float(w_kept.min()) if w_kept.numel() else 0.0,
        "is_weight_mean": float(w_kept.mean()) if w_kept.numel() else 0.0,
        "is_weight_max": float(w_kept.max()) if w_kept.numel() else 0.0,
        "is_ess": effective_sample_size(w_valid),
        "is_masked_frac": 1.0 - w_kept.numel() / n_valid if n_valid else 0.0,
    }


def drift_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean/abs-mean/max-abs log ratio (policy over behaviour) and KL(P || pi) as k1 and k3 (k3
    low by pi's mass outside P's support: see above)."""
    lr = valid_values(log_ratio, mask)
    if lr.numel() == 0:
        return {"log_ratio_mean": 0.0, "log_ratio_abs_mean": 0.0, "log_ratio_abs_max": 0.0,
                "kl_k1": 0.0, "kl_k3": 0.0}
    k1, k3 = kl_estimates(lr)
    return {
        "log_ratio_mean": float(lr.mean()),
        "log_ratio_abs_mean": float(lr.abs().mean()),
        "log_ratio_abs_max": float(lr.abs().max()),
        "kl_k1": k1,
        "kl_k3": k3,
    }


def quantiles(x: torch.Tensor, qs=(0.5, 0.9, 0.99)) -> dict[str, float]:
    """mean and quantiles (p50/p90/p99 keys) of a 1-D tensor; NaN when empty."""
    x = x.double()
    if x.numel() == 0:
        return {"mean": math.nan, **{f"p{round(q * 100)}": math.nan for q in qs}}
    return {"mean": float(x.mean()), **{f"p{round(q * 100)}": float(torch.quantile(x, q)) for q in qs}}


# ----------------------------------------------------------------------------- accuracy
def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n; (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else min(p, max(0.0, centre - half))  # exact ends where rounding would cross p
    hi = 1.0 if k == n else max(p, min(1.0, centre + half))
    return lo, hi


def accuracy_stats(rewards: list[float]) -> dict:
    """k, n, accuracy and its Wilson interval (a reward >= 1 counts as correct)."""
    n = len(rewards)
    k = sum(1 for r in rewards if r >= 1.0)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "mean": k / n if n else None, "ci_low": lo, "ci_high": hi}


def compare_accuracy(a: dict, b: dict) -> dict:
    """Gap a - b with Newcombe's interval, a two-proportion z-test and whether the intervals overlap."""
    if not a["n"] or not b["n"]:
        return {"diff": None, "diff_ci_low": None, "diff_ci_high": None, "z": None, "p_value": None,
                "intervals_overlap": None}
    pa, pb = a["k"] / a["n"], b["k"] / b["n"]
    d = pa - pb
    lo = d - math.sqrt((pa - a["ci_low"]) ** 2 + (b["ci_high"] - pb) ** 2)
    hi = d + math.sqrt((a["ci_high"] - pa) ** 2 + (pb - b["ci_low"]) ** 2)
    pool = (a["k"] + b["k"]) / (a["n"] + b["n"])
    se = math.sqrt(pool * (1 - pool) * (1 / a["n"] + 1 / b["n"]))
    z = d / se if se > 0 else 0.0
    return {"diff": d, "diff_ci_low": lo, "diff_ci_high": hi, "z": z, "p_value": math.erfc(abs(z) / math.sqrt(2)),
            "intervals_overlap": a["ci_low"] <= b["ci_high"] and b["ci_low"] <= a["ci_high"]}
