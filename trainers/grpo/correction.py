"""Off-policy correction: importance weights from the behaviour log-probs of a rollout.

Vocabulary:
- **behaviour log-prob** log P(y): the log-probability with which the verifier really
  emitted token y (recorded by the rollout; P is the induced distribution, see
  verifiers/README.md). **logp_old** log pi_old(y): the policy's log-prob of the same token,
  recomputed by the trainer at the start of the step.
- **log ratio** per token: log r = logp_old - behaviour_logp. r = 1 for every token of a
  lossless rollout with the current weights.
- **sequence log ratio**: the sum of a sequence's token log ratios (log of the product);
  **geometric-mean log ratio**: their mean.
- **modes**:
  none      w = 1.
  token_tis w = min(r, cap) per token (truncated IS).
  token_mis w = r where low <= r <= high, else 0 and the token is masked (IcePop-style).
  seq_tis   w = min(prod r, cap) for every token of the sequence.
  seq_mis   w = prod r where low <= prod r <= high, else 0 and the sequence is masked.
  geo_mis   sequences whose geometric-mean ratio exp(mean log r) lies outside [low, high]
            are masked; inside, each token gets the token-level truncated weight
            min(r, cap). (Our choice: the geometric mean is a length-normalised
            rejection test; per-token weights are the ones that are unbiased per position,
            verifiers/README.md, "What the behaviour log-prob is conditioned on".)
- **keep mask**: the valid tokens that survived masking. Weights are 0 outside it.
  Passing ``mask`` to the loss keeps masked tokens in its denominator (they contribute 0);
  passing ``mask & keep`` renormalises over the kept tokens.

Everything is computed in log space (float64): sequence products of thousands of tokens
neither overflow nor underflow before truncation or the bound test. Weights are detached.

A token outside the trainer's support (logp_old = -inf: with ``top_p``/``top_k`` the trainer
cuts the distribution with its own logits, and a token at the cut's edge that the rollout's
slightly different logits kept can fall outside it) has pi_old(y) / P(y) = 0: weight 0 and
masked in every mode (in the sequence modes its sequence's product is 0 too), left out of the
drift statistics (KL(P || pi) is infinite there) and counted as ``is_outside_support_frac``.
Support that P does not cover (pi(y) > 0 where P(y) = 0) cannot be corrected by any
weight; it shows up only as missing mass (the drift study's uncovered mass, ``trainers.drift``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollout.config import ConfigError, check_number
from trainers.drift.stats import drift_stats, weight_stats

MODES = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis")


@dataclass(frozen=True)
class CorrectionConfig:
    mode: str = "token_tis"  # one of MODES, see the module docstring
    cap: float = 2.0  # truncation C of the *_tis modes and of geo_mis' token weights; >= 1
    low: float = 0.5  # lower bound of the *_mis modes; in [0, 1]
    high: float = 2.0  # upper bound of the *_mis modes; >= 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError("mode", f"unknown correction mode {self.mode!r}", allowed=MODES)
        check_number("cap", self.cap, 1)
        check_number("low", self.low, 0, 1)
        check_number("high", self.high, 1)
        if self.low >= self.high:
            raise ConfigError("low", f"must be below high ({self.high}), got {self.low}")


def _check(logp_old, behaviour_logp, mask):
    if logp_old.dim() != 2 or logp_old.shape != behaviour_logp.shape or logp_old.shape != mask.shape:
        raise ValueError("logp_old, behaviour_logp and mask must share one [N, T] shape, got "
                         f"{tuple(logp_old.shape)}, {tuple(behaviour_logp.shape)}, {tuple(mask.shape)}")
    valid = mask.bool()
    for name, t in (("logp_old", logp_old), ("behaviour_logp", behaviour_logp)):
        bad = valid & ~torch.isfinite(t)
        if name == "logp_old":
            bad &= t != -math.inf  # outside the trainer's support: a weight of 0 (module doc)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{name} is not finite at a valid token (row {row}, position {col})")


def _in_bounds(log_x: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    log_low = math.log(cfg.low) if cfg.low > 0 else -math.inf
    return (log_x >= log_low) & (log_x <= math.log(cfg.high))


def importance_weights(logp_old: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                       cfg: CorrectionConfig,
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token weights [N, T] (detached, dtype of logp_old), keep mask [N, T] and stats.

    logp_old, behaviour_logp, mask: [N, T]; positions outside ``mask`` are ignored and get
    weight 0. Stats: weight min/mean/max, ESS, masked fraction and drift (``trainers.drift.stats``).
    """
    _check(logp_old, behaviour_logp, mask)
    valid = mask.bool()  # [N, T]
    inside = valid & (logp_old != -math.inf)  # outside: pi_old(y) = 0, so log r = -inf
    log_r = torch.where(valid, logp_old.detach().double() - behaviour_logp.detach().double(),
                        torch.zeros((), dtype=torch.float64))  # [N, T]
    log_cap = math.log(cfg.cap)
    if cfg.mode == "none":
        log_w, keep = torch.zeros_like(log_r), valid
    elif cfg.mode == "token_tis":
        log_w, keep = log_r.clamp(max=log_cap), valid
    elif cfg.mode == "token_mis":
        log_w, keep = log_r, valid & _in_bounds(log_r, cfg)
    else:
        seq_log_r = log_r.sum(dim=1, keepdim=True)  # [N, 1], log of the product of ratios
        if cfg.mode == "seq_tis":
            log_w, keep = seq_log_r.clamp(max=log_cap).expand_as(log_r), valid
        elif cfg.mode == "seq_mis":
            log_w, keep = seq_log_r.expand_as(log_r), valid & _in_bounds(seq_log_r, cfg)
        else:  # geo_mis
            counts = valid.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
            geo_log_r = seq_log_r / counts  # [N, 1]
            log_w, keep = log_r.clamp(max=log_cap), valid & _in_bounds(geo_log_r, cfg)
    keep = keep & inside
    # exp only where kept: a masked sequence's product may be huge, and is never used
    weights = torch.where(keep, torch.exp(torch.where(keep, log_w, 0.0)), 0.0)  # [N, T]
    stats = weight_stats(weights, keep, valid)
    stats.update(drift_stats(log_r, inside))
    stats["is_outside_support_frac"] = float((valid & ~inside).sum()) / max(int(valid.sum()), 1)
    return weights.to(logp_old.dtype), keep, stats
