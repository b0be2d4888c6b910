"""The planner's measured costs: recent values and the cost curve over block rows (synthetic
measurements, deterministic; no models)."""

from __future__ import annotations

import pytest

from rollout.engine.planner import RoundPlanner, bucket
from rollout.engine.planner_costs import Recent, read_curve
from rollout.params import SpecConfig


def test_round_cost_interpolates_between_measured_blocks():
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=5, max_batch="auto"), adaptive_k=True)
    planner.observe(2, 0, 1.0, 0.0, [1, 1])
    assert planner.round_cost(2, 3) is None
    planner.observe(2, 5, 2.0, 0.5, [1, 1])
    assert planner.round_cost(2, 1) == 1.0 and planner.round_cost(2, 6) == 2.0
    assert planner.round_cost(2, 4) == pytest.approx(1.6)
    assert planner.cost(2, 3) == pytest.approx(1.6 + 3 * 0.1)  # + 3 draft steps of 0.5 / 5 s
    assert planner.round_cost(8, 1) == planner.round_cost(2, 4)  # the same block rows, in any bucket


def test_one_slow_round_does_not_move_the_cost():
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"))
    for s in (1.0, 1.1, 0.9, 10.0, 1.0):  # one round hit by another process
        planner.observe(1, 0, s, 0.0, [1])
    assert planner.round_cost(1, 1) == 1.0
    for _ in range(3):  # a lasting change is followed
        planner.observe(1, 0, 3.0, 0.0, [1])
    assert planner.round_cost(1, 1) == 3.0


def test_costs_are_judged_on_recent_measurements():
    r = Recent()
    for t in range(4):
        r.add(3.0, now=t)  # busy, long ago
    r.add(1.0, now=200)
    assert r.value == 1.0  # the only one within the window of the newest
    r.add(1.2, now=201)
    assert r.value == pytest.approx(1.1)
    fresh = Recent()
    for t, x in enumerate((1.0, 1.1, 0.9, 10.0, 1.0)):
        fresh.add(x, now=t)
    assert fresh.value == 1.0


def test_costs_follow_the_rows_within_a_bucket():
    """Regression: rows finish within a call, so a bucket's options get measured at different
    batch sizes. A plain round measured at 16 rows (1.8 s) and a chain of one measured at 10
    rows (2.2 s, 20 block rows) on a machine where a forward costs 0.2 + 0.1 s per row: at
    10 rows plain costs 1.2 s and wins (0.83 against 0.73 tokens/s per row); taken at face
    value, the chain looked better."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto"))
    planner.prior_weight = 0.0
    planner.observe(16, 0, 1.8, 0.0, [1] * 16)
    planner.observe(10, 1, 2.2, 0.0, [2, 2, 2, 2, 2, 2, 1, 1, 1, 1], catch_up=False)  # E(1) = 1.6
    assert planner.round_cost(10, 1) == pytest.approx(1.2) and planner.round_cost(10, 2) == pytest.approx(2.2)
    assert planner.round_cost(16, 1) == pytest.approx(1.8) and planner.round_cost(16, 2) == pytest.approx(3.4)
    rates = planner.rates(10, switching=False)
    assert rates[0] == pytest.approx(1 / 1.2) and rates[1] == pytest.approx(1.6 / 2.2)
    planner._last_run = {(bucket(10), 0): 0, (bucket(10), 1): 0}  # both measured: it chooses by rate
    assert [planner.choose(10) for _ in range(3)] == [0, 0, 0]


def test_the_cost_curve_pools_buckets_and_never_decreases():
    """Regression (batch 32, lossless): a plain round measured over 32 rows in a busy second and
    a chain of one over 20 rows (40 block rows) in a quiet one; a line through the two read the
    chain's block as cheaper than a plain round over the same 20 rows, and the planner drafted
    at 0.8-0.9x plain decoding. The points are pooled instead; and a point of another bucket
    over the same block rows counts."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto"))
    planner.observe(32, 0, 1.0, 0.0, [1] * 32)
    planner.observe(20, 1, 0.9, 0.1, [2] * 20)
    assert planner.round_cost(20, 2) >= planner.round_cost(20, 1)
    assert planner.round_cost(20, 2) == pytest.approx(0.95)
    planner.observe(16, 0, 0.6, 0.0, [1] * 16)  # bucket 16: a plain round over 16 rows
    planner.observe(8, 1, 0.6, 0.05, [2] * 8)  # bucket 8: a chain of one over 8 rows, 16 block rows
    assert planner.round_cost(16, 1) == planner.round_cost(8, 2) == pytest.approx(0.6)
    assert planner.round_cost(24, 1) == pytest.approx(0.6 + (24 - 16) * (0.95 - 0.6) / (36 - 16))
    xs = [x for x, _ in planner._curve()]
    ys = [y for _, y in planner._curve()]
    assert xs == sorted(xs) and ys == sorted(ys)


def test_a_measurement_window_rounds_old_is_still_fresh():
    """``Recent``: the measurements taken within ``window`` rounds of the newest one count, that
    many rounds back included, and one round more is stale."""
    recent = Recent(keep=5, window=48)
    recent.add(10.0, now=0)
    recent.add(1.0, now=47)
    recent.add(2.0, now=48)
    assert recent.fresh() == [10.0, 1.0, 2.0] and recent.value == 2.0
    recent.add(3.0, now=49)
    assert recent.fresh() == [1.0, 2.0, 3.0] and recent.value == 2.0


def test_a_curve_read_below_its_first_point_never_goes_below_a_positive_floor():
    """``read_curve`` extrapolates along the nearest segment, but a steep first segment read far to
    its left would give a cost of zero or less (an option that looks free, or a rate of the wrong
    sign): the cost read is at least 1e-9."""
    curve = [(4.0, 1.0), (8.0, 3.0)]
    assert read_curve(curve, 6.0) == 2.0 and read_curve(curve, 10.0) == 4.0
    assert read_curve(curve, 2.0) == 1e-9 and read_curve(curve, 1.0) == 1e-9
