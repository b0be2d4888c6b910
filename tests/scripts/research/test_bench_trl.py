"""scripts.research.bench_trl's interval of a median ratio (pure; no models)."""

from __future__ import annotations

import random
import statistics

from scripts.research.bench_trl import median_interval


def test_the_median_interval_brackets_the_median_and_narrows_with_rounds():
    rng = random.Random(1)
    few = [1.0 + rng.gauss(0, 0.1) for _ in range(7)]
    many = [1.0 + rng.gauss(0, 0.1) for _ in range(200)]
    for xs in (few, many):
        lo, hi = median_interval(xs)
        assert lo <= statistics.median(xs) <= hi
        assert min(xs) <= lo and hi <= max(xs)
    assert median_interval(many)[1] - median_interval(many)[0] < median_interval(few)[1] - median_interval(few)[0]
    assert median_interval([0.9] * 6) == (0.9, 0.9)


def test_the_interval_follows_the_level_and_is_seeded():
    xs = [0.8, 0.9, 0.95, 1.0, 1.02, 1.05, 1.1, 1.3]
    assert median_interval(xs, seed=3) == median_interval(xs, seed=3)
    lo50, hi50 = median_interval(xs, level=0.5)
    lo90, hi90 = median_interval(xs, level=0.9)
    assert lo90 <= lo50 <= hi50 <= hi90
