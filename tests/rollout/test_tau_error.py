"""tau's standard error over rows (``rollout.outputs.tau_with_error``): the closed form on a hand
example, the edge cases, and a Monte Carlo check that it matches the spread of tau across
repeated calls when rows differ in acceptance (where treating rounds as independent does not)."""

import math
import random
import statistics

import pytest

from rollout.outputs import tau_with_error


def test_hand_example():
    # rows: tokens 6, 2, 4 over 3, 2, 1 rounds -> tau 2; residuals 0, -2, 2
    tau, se = tau_with_error([[2, 1, 3], [1, 1], [4]])
    assert tau == 2.0
    assert se == pytest.approx(math.sqrt(8 / (3 * 2)) / 2)


def test_edge_cases():
    assert tau_with_error([]) == (0.0, pytest.approx(math.nan, nan_ok=True))
    tau, se = tau_with_error([[], [3, 1]])  # a row without rounds (max_new_tokens 1) is not a unit
    assert tau == 2.0 and math.isnan(se)
    tau, se = tau_with_error([[], [3, 1], [2]])
    assert tau == 2.0 and se == pytest.approx(math.sqrt((0 + 0) / 2) / 1.5)


def _call(rng: random.Random, rows: int, k: int = 6) -> list[list[int]]:
    """One simulated call: each row has its own acceptance rate and length; a round emits
    1 + the accepted drafts (each accepted with the row's rate until the first rejection, at most k)."""
    out = []
    for _ in range(rows):
        rate, rounds = rng.uniform(0.2, 0.85), rng.randint(4, 40)
        row = []
        for _ in range(rounds):
            n = 1
            while n <= k and rng.random() < rate:
                n += 1
            row.append(n)
        out.append(row)
    return out


def test_error_matches_the_spread_of_tau_across_calls():
    rng = random.Random(0)
    taus, ses, naive = [], [], []
    for _ in range(400):
        rows = _call(rng, 24)
        tau, se = tau_with_error(rows)
        taus.append(tau)
        ses.append(se)
        flat = [x for r in rows for x in r]  # every round as an independent draw
        naive.append(statistics.stdev(flat) / math.sqrt(len(flat)))
    spread = statistics.stdev(taus)
    assert statistics.mean(ses) == pytest.approx(spread, rel=0.15), (statistics.mean(ses), spread)
    assert statistics.mean(naive) < 0.75 * spread  # why the rows are the units
