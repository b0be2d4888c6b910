"""The study's statistics against direct computations: the two-way bootstrap against its slow
reference and against the normal interval it approaches, the pairing by seed and problem, bands,
run totals, and the verdict's wording rules."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainers.study import stats
from trainers.study.verdict import difference_sentence, drift_sentence, seeds_caveat, speed_sentence


def _answers(seed: int, seeds=(0, 1, 2), n: int = 30, p: float = 0.5) -> dict[int, dict[str, int]]:
    rng = random.Random(seed)
    return {s: {f"q{i}": int(rng.random() < p) for i in range(n)} for s in seeds}


@pytest.mark.parametrize("shape", [(1, 7), (2, 13), (4, 9)])
def test_bootstrap_equals_its_slow_reference(shape):
    grid = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(3)).double() - torch.rand(shape) * 0.5
    fast = stats.two_way_bootstrap(grid, 300, seed=5)
    slow = stats.two_way_bootstrap_reference(grid, 300, seed=5)
    assert fast == pytest.approx(slow, abs=1e-12)
    assert fast != stats.two_way_bootstrap(grid, 300, seed=6)  # the seed matters (a fixed generator, not global state)


def test_bootstrap_with_one_seed_approaches_the_normal_interval():
    # one seed: only the problems are resampled; the percentile interval of a mean of n = 400
    # Bernoulli values approaches mean +- 1.96 sd / sqrt(n), within Monte Carlo error
    rng = random.Random(0)
    row = [float(rng.random() < 0.4) for _ in range(400)]
    lo, hi = stats.two_way_bootstrap([row], 8000, seed=1)
    m = sum(row) / len(row)
    half = 1.959964 * math.sqrt(m * (1 - m) / len(row))
    assert lo == pytest.approx(m - half, abs=0.006) and hi == pytest.approx(m + half, abs=0.006)


def test_bootstrap_with_seeds_that_differ_is_wider_than_over_problems_alone():
    # the same problems, two seeds a constant 0.3 apart: the seed part widens the interval
    rng = random.Random(2)
    base = [float(rng.random() < 0.5) for _ in range(200)]
    lo1, hi1 = stats.two_way_bootstrap([base, base], 2000, seed=0)
    lo2, hi2 = stats.two_way_bootstrap([[min(1.0, x + 0.3) for x in base], [max(0.0, x - 0.3) for x in base]], 2000, seed=0)
    assert hi2 - lo2 > 1.5 * (hi1 - lo1)


def test_accuracy_and_paired_difference_equal_direct_computation():
    a, b = _answers(1), _answers(2)
    b.pop(2)  # seed 2 only in a: the difference pairs seeds 0 and 1
    for s in (0, 1):
        del b[s]["q3"]  # one problem missing on one side: left out of the pairing
        b[s] = dict(reversed(b[s].items()))  # and the other side's in another order: paired by id
    acc = stats.accuracy(a, 500, seed=0)
    cells = [a[s][f"q{i}"] for s in (0, 1, 2) for i in range(30)]
    assert acc["mean"] == pytest.approx(sum(cells) / len(cells))
    assert acc["per_seed"] == pytest.approx([sum(a[s].values()) / 30 for s in (0, 1, 2)])
    assert (acc["seeds"], acc["n_problems"]) == ([0, 1, 2], 30)
    grid = [[float(a[s][f"q{i}"]) for i in range(30)] for s in (0, 1, 2)]
    assert (acc["ci_low"], acc["ci_high"]) == pytest.approx(stats.two_way_bootstrap(grid, 500, 0))

    d = stats.paired_difference(a, b, 500, seed=0)
    ids = [f"q{i}" for i in range(30) if i != 3]
    diff = [[a[s][i] - b[s][i] for i in ids] for s in (0, 1)]
    assert (d["seeds"], d["n_problems"]) == ([0, 1], 29)
    assert d["mean"] == pytest.approx(sum(map(sum, diff)) / 58)
    assert d["per_seed"] == pytest.approx([sum(r) / 29 for r in diff])
    assert (d["ci_low"], d["ci_high"]) == pytest.approx(stats.two_way_bootstrap(diff, 500, 0))
    assert d["ci_low"] <= d["mean"] <= d["ci_high"]
    assert stats.paired_difference(a, {7: {"q1": 1}}, 500, 0) is None and stats.accuracy({}, 500, 0) is None


def test_a_setting_against_itself_differs_by_exactly_zero():
    a = _answers(4)
    d = stats.paired_difference(a, a, 300, 0)
    assert (d["mean"], d["ci_low"], d["ci_high"]) == (0.0, 0.0, 0.0)


def test_band_run_totals_spread_and_ratios():
    assert stats.band({0: {0: 0.1, 1: 0.3, 2: 0.5}, 1: {0: 0.3, 1: 0.1, 2: float("nan")}}) == [
        (0, pytest.approx(0.2), 0.1, 0.3), (1, pytest.approx(0.2), 0.1, 0.3)]
    rows = [{"step": 1, "rollout_s": 2.0, "rollout_tokens": 100, "tau": 2.0, "kl_k1": 0.1, "kl_k3": 0.05,
             "is_ess": 0.9, "step_s": 10.0},
            {"step": 2, "rollout_s": 3.0, "rollout_tokens": 200, "tau": 3.0, "kl_k1": 0.3, "kl_k3": 0.15,
             "is_ess": 0.7, "step_s": 12.0}]
    t = stats.run_totals(rows)
    assert t["tokens_per_s"] == pytest.approx(300 / 5) and t["rollout_s"] == 5.0  # a ratio of sums, not a mean of ratios
    assert (t["tau"], t["kl_k1"], t["kl_k3"], t["is_ess"], t["step_s"]) == pytest.approx((2.5, 0.2, 0.1, 0.8, 11.0))
    assert stats.spread([1.0, None, 3.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert stats.seed_ratios({0: 2.0, 1: 3.0, 2: 1.0}, {0: 1.0, 1: 2.0}) == {"mean": 1.75, "min": 1.5, "max": 2.0, "n": 2}


def _cmp(mean, lo, hi, seeds=(0, 1, 2), n=40):
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "per_seed": [], "seeds": list(seeds), "n_problems": n}


def test_verdict_never_claims_more_than_the_interval():
    inside = difference_sentence(_cmp(-0.05, -0.12, 0.02), "lossless", "reference", "0")
    assert "no difference detected at this size" in inside and "-0.050" in inside and "[-0.120, +0.020]" in inside
    assert "below" not in inside and "above" not in inside
    edge = difference_sentence(_cmp(0.1, 0.0, 0.2), "lossless", "reference", "1")
    assert "no difference detected" in edge  # an interval touching 0 does not exclude it
    below = difference_sentence(_cmp(-0.1, -0.18, -0.02), "mars_none", "uncorrected", "1")
    assert "below by 0.100" in below and "what the correction buys back" in below
    above = difference_sentence(_cmp(0.08, 0.01, 0.15), "typical_sampling", "baseline", "0")
    assert "above by 0.080" in above and "matched baseline" in above
    assert "no finished pair" in difference_sentence(None, "lossless", "reference", "0")
    assert "cover the held-out problems only" in seeds_caveat(1) and "barely" in seeds_caveat(2)
    assert seeds_caveat(3) is None
    assert "mixed across seeds" in speed_sentence({"mean": 1.0, "min": 0.9, "max": 1.1, "n": 2}, None, "lossless")
    assert "faster in every seed" in speed_sentence({"mean": 1.2, "min": 1.1, "max": 1.3, "n": 2}, None, "lossless")
    one = speed_sentence({"mean": 1.2, "min": 1.2, "max": 1.2, "n": 1}, None, "lossless")
    assert "single pair of runs" in one and "every seed" not in one
    training = {k: {"mean": v} for k, v in (("kl_k1", 0.1), ("kl_k3", 0.05), ("is_ess", 1.0))}
    assert "IS ESS" not in drift_sentence(training, corrected=False)  # no weights applied: ESS 1 says nothing
    assert "IS ESS of the applied weights 1.000" in drift_sentence(training, corrected=True)
