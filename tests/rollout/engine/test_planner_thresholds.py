"""The planner's hysteresis and call boundaries on synthetic costs (deterministic; no models):
``stay`` applies while drafting, ``hold`` after plain rounds, and a new call's first draft is a
switch (it catches up on the prompt)."""

from __future__ import annotations

from rollout.engine.planner import BEST, NO_CLEAR_GAIN, REPROBE, RoundPlanner
from rollout.params import SpecConfig
from tests.rollout.engine.planner_sim import simulate


def test_a_gain_between_stay_and_hold_keeps_drafting_but_does_not_leave_plain_rounds():
    """A chain of one 6% ahead of plain rounds (stay 4% < 6% < hold 8%): while drafting it is
    kept (plain rounds come back only as re-probes); after plain rounds it is not taken for the
    gain (drafting resumes only as a re-probe of the chain)."""
    spec = SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    assert planner.stay < 0.06 < planner.hold
    planner.trace = []
    simulate(planner, 16, 80, lambda b, k: 1.0 if k == 0 else 1.6 / 1.06, accept=0.6)  # E(1) = 1.6
    trace = planner.trace[2:]  # after the new bucket's two probes
    for prev, rec in zip(planner.trace[1:], trace):
        if prev["k"] and not rec["k"]:  # drafting -> plain: only to re-measure plain rounds
            assert rec["why"] == REPROBE, (prev, rec)
        if not prev["k"] and rec["k"]:  # plain -> drafting: only as a re-probe, not for a 6% gain
            assert rec["why"] == REPROBE, (prev, rec)
        if prev["k"] and rec["k"]:
            assert rec["why"] == BEST
    assert any(r["why"] == NO_CLEAR_GAIN for r in trace), "plain rounds are held for the small gain"
    assert sum(r["k"] for r in trace) > len(trace) / 3


def test_a_new_call_charges_its_first_draft_the_switch():
    """A call's first draft consumes the prompt (a catch-up): after ``new_call`` the options are
    rated as from plain rounds, with the switch cost, even if the last call ended drafting."""
    spec = SpecConfig(mode="chain", num_draft_tokens=2, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    chosen = simulate(planner, 1, 30, lambda b, k: 1.0 + 0.1 * k, accept=0.8, draft=0.05, switch=2.0)
    assert chosen[-1] > 0, chosen  # the call ends drafting
    assert planner.rates(1) == planner.rates(1, switching=False)
    planner.new_call()
    rates, switched, not_switched = planner.rates(1), planner.rates(1, switching=True), planner.rates(1, False)
    assert rates == switched
    assert all(switched[k] < not_switched[k] for k in switched if k), (switched, not_switched)
