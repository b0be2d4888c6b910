"""The study's statistics, computed once here (``report`` reads the run folders and calls these;
``plots`` draws what they return). Pure functions over plain numbers.

Vocabulary:
- **answers**: one setting's final held-out answers, ``{seed: {problem id: 0 or 1}}``.
- **grid**: answers as a matrix ``[S seeds, N problems]`` over a fixed order of seeds and ids.
- **accuracy**: the grid's mean (every seed and problem weighs the same).
- **paired difference** of settings a and b: mean(a's grid - b's grid) over the seeds both have
  and the problems every one of those runs answered: the same seed (training problems, rollout
  seeds) and the same problem (and evaluation draws) on both sides.
- **two-way bootstrap** (every 95% interval of the report): a draw resamples the S seeds with
  replacement and, independently, the N problems with replacement, and takes the mean of the
  S x N resampled cells; the interval is the 2.5th and 97.5th percentiles (linear interpolation)
  of ``draws`` such means from a generator seeded with ``seed``. It covers both sources of noise,
  the training run (seed) and the held-out sample (problem). A difference is bootstrapped on its
  difference grid, so both settings move with the same draws (paired). Caveats: with few seeds the
  seed part is itself poorly sampled (two seeds give the sets {a, a}, {a, b}, {b, b}), so the
  interval is too narrow, and with one seed it covers the problems only; the verdicts say so.
- **band**: at each step, the mean of the seeds' values and their minimum and maximum.
- **run totals**: a run's rollout tokens over its rollout seconds (tokens/s), its rollout seconds
  in all, and the means over its steps of tau, KL(P || pi) (k1, k3), IS ESS and step seconds.
- **spread**: a setting's run values as their mean, minimum and maximum over seeds.
"""

from __future__ import annotations

import math

import torch

LEVEL = 0.95


# ----------------------------------------------------------------------------- the bootstrap
def bootstrap_draws(n_seeds: int, n_problems: int, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The resampled indices: seeds ``[draws, n_seeds]`` and problems ``[draws, n_problems]``."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(n_seeds, (draws, n_seeds), generator=g)
    problems = torch.randint(n_problems, (draws, n_problems), generator=g)
    return seeds, problems


def _check_grid(grid) -> torch.Tensor:
    g = torch.as_tensor(grid, dtype=torch.float64)
    if g.dim() != 2 or g.shape[0] < 1 or g.shape[1] < 1:
        raise ValueError(f"a grid is [seeds, problems] with at least one of each, got shape {tuple(g.shape)}")
    return g


def two_way_bootstrap(grid, draws: int, seed: int, level: float = LEVEL) -> tuple[float, float]:
    """The two-way bootstrap interval of the mean of ``grid [S, N]`` (module docstring): each draw's
    mean as (seed counts) @ grid @ (problem counts) / (S N)."""
    g = _check_grid(grid)
    n_s, n_p = g.shape
    s_idx, p_idx = bootstrap_draws(n_s, n_p, draws, seed)
    one = torch.ones((), dtype=torch.float64)
    s_counts = torch.zeros(draws, n_s, dtype=torch.float64).scatter_add_(1, s_idx, one.expand(s_idx.shape))  # [B, S]
    p_counts = torch.zeros(draws, n_p, dtype=torch.float64).scatter_add_(1, p_idx, one.expand(p_idx.shape))  # [B, N]
    means = torch.einsum("bs,sn,bn->b", s_counts, g, p_counts) / (n_s * n_p)  # [draws]
    q = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(q[0]), float(q[1])


def _percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between neighbours (position q (n - 1))."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def two_way_bootstrap_reference(grid, draws: int, seed: int, level: float = LEVEL) -> tuple[float, float]:
    """:func:`two_way_bootstrap` the slow, obvious way: index the resampled cells one by one."""
    rows = _check_grid(grid).tolist()
    n_s, n_p = len(rows), len(rows[0])
    s_idx, p_idx = bootstrap_draws(n_s, n_p, draws, seed)
    means = []
    for seeds, problems in zip(s_idx.tolist(), p_idx.tolist()):
        means.append(sum(rows[s][i] for s in seeds for i in problems) / (n_s * n_p))
    means.sort()
    return _percentile(means, (1 - level) / 2), _percentile(means, (1 + level) / 2)


# ----------------------------------------------------------------------------- accuracy and differences
def _common(answers: list[dict[int, dict[str, int]]]) -> tuple[list[int], list[str]]:
    """The seeds every answer set has, and the problem ids every one of those runs answered (in
    the first run's order)."""
    seeds = sorted(set.intersection(*(set(a) for a in answers))) if answers else []
    if not seeds:
        return [], []
    runs = [a[s] for a in answers for s in seeds]
    ids = [i for i in runs[0] if all(i in r for r in runs)]
    return seeds, ids


def grid_of(answers: dict[int, dict[str, int]], seeds: list[int], ids: list[str]) -> list[list[float]]:
    return [[float(answers[s][i]) for i in ids] for s in seeds]


def _interval(grid: list[list[float]], draws: int, seed: int) -> dict:
    g = torch.tensor(grid, dtype=torch.float64)
    lo, hi = two_way_bootstrap(g, draws, seed)
    return {"mean": float(g.mean()), "ci_low": lo, "ci_high": hi, "per_seed": g.mean(dim=1).tolist()}


def accuracy(answers: dict[int, dict[str, int]], draws: int, seed: int) -> dict | None:
    """Accuracy with its two-way bootstrap interval, per-seed accuracies, the seeds and the problem
    count; None without answers."""
    seeds, ids = _common([answers])
    if not ids:
        return None
    return {**_interval(grid_of(answers, seeds, ids), draws, seed), "seeds": seeds, "n_problems": len(ids)}


def paired_difference(a: dict[int, dict[str, int]], b: dict[int, dict[str, int]], draws: int, seed: int) -> dict | None:
    """a minus b over the (seed, problem) cells both have, with its interval and per-seed
    differences; None when they share none."""
    seeds, ids = _common([a, b])
    if not ids:
        return None
    ga, gb = grid_of(a, seeds, ids), grid_of(b, seeds, ids)
    diff = [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(ga, gb)]
    return {**_interval(diff, draws, seed), "seeds": seeds, "n_problems": len(ids)}


# ----------------------------------------------------------------------------- curves and run totals
def band(series: dict[int, dict[int, float]]) -> list[tuple[int, float, float, float]]:
    """``(step, mean, min, max)`` over the seeds of ``{seed: {step: value}}`` at every step that
    each seed has (non-finite values dropped first)."""
    clean = {s: {k: v for k, v in vals.items() if v is not None and math.isfinite(v)} for s, vals in series.items()}
    if not clean:
        return []
    steps = sorted(set.intersection(*(set(v) for v in clean.values())))
    out = []
    for k in steps:
        vals = [v[k] for v in clean.values()]
        out.append((k, sum(vals) / len(vals), min(vals), max(vals)))
    return out


TRAINING_MEANS = ("tau", "kl_k1", "kl_k3", "is_ess", "step_s")


def run_totals(rows: list[dict]) -> dict[str, float | None]:
    """A run's totals from its ``metrics.jsonl`` rows (module docstring); None where it logged none."""
    seconds = sum(r.get("rollout_s", 0.0) for r in rows)
    tokens = sum(r.get("rollout_tokens", 0.0) for r in rows)
    out: dict[str, float | None] = {"steps": float(len(rows)), "rollout_s": seconds, "rollout_tokens": tokens,
                                    "tokens_per_s": tokens / seconds if seconds > 0 else None}
    for key in TRAINING_MEANS:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        out[key] = sum(vals) / len(vals) if vals else None
    return out


def spread(values: list[float | None]) -> dict | None:
    """Mean, min and max of the values that are not None; None if there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def seed_ratios(a: dict[int, float | None], b: dict[int, float | None]) -> dict | None:
    """The spread over the seeds both have of a[seed] / b[seed]."""
    return spread([a[s] / b[s] for s in sorted(set(a) & set(b)) if a[s] is not None and b[s]])
