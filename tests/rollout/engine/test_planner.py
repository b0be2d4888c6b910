"""The round planner on synthetic costs and acceptance (deterministic; no models): its model
(buckets, acceptance, re-probe intervals) and its choices (when it drafts and how long a chain,
what it runs again, why: the trace). Catch-ups, calls and buckets: ``test_planner_switching.py``."""

from __future__ import annotations

import pytest

from rollout.engine.planner import REPROBE, RoundPlanner, bucket
from rollout.engine.planner_costs import Recent
from rollout.params import SpecConfig
from tests.rollout.engine.planner_sim import cpu_like, kernel_like, simulate


def test_bucket():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 6]


def test_it_drafts_at_batch_one_and_stops_drafting_at_large_batches():
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    small = simulate(RoundPlanner.for_spec(spec), 1, 60, cpu_like, accept=0.6)
    large = simulate(RoundPlanner.for_spec(spec), 64, 60, cpu_like, accept=0.6)
    assert small[:2] == [0, 3] and large[:2] == [0, 3]  # it measures both extremes first
    assert small[2:].count(3) >= len(small) - 2 - 3, small  # drafts, except for re-probes of plain rounds
    assert large[2:] == [0] * (len(large) - 2), large  # far behind plain: not run again in 60 rounds


def test_the_nearest_alternative_is_measured_again():
    """An option within ``margin`` of the best is re-run once per ``reprobe`` rounds; when it
    becomes the better one (the costs changed), the planner switches to it."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    near = lambda b, k: 1.0 if k == 0 else 1.95  # noqa: E731  (E(3) = 2.18 at 0.6: plain within margin)
    chosen = simulate(planner, 1, 100, near, accept=0.6)
    assert 0 < chosen[2:].count(0) <= 100 // planner.reprobe + 1, chosen
    cheaper = lambda b, k: 1.0 if k == 0 else 1.5  # noqa: E731
    later = simulate(planner, 1, 40, cheaper, accept=0.6)
    assert later[-10:] == [3] * 10, later


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("accept", [0.3, 0.6, 0.8])
def test_never_much_slower_than_the_best_fixed_choice(batch, accept):
    """Over 150 rounds the planner's time per token is within 5% of the best fixed choice
    (plain or one chain length), probes included."""
    spec = SpecConfig(mode="chain", num_draft_tokens=5, max_batch="auto", adaptive_k=True)
    planner = RoundPlanner.for_spec(spec)
    rounds = 150
    chosen = simulate(planner, batch, rounds, kernel_like, accept=accept)

    def tokens(k):
        return sum(accept ** i for i in range(k + 1))

    spent = sum(kernel_like(batch, k) for k in chosen)
    made = sum(tokens(k) for k in chosen)
    best = max(tokens(k) / kernel_like(batch, k) for k in range(6))
    assert made / spent >= 0.95 * best, (chosen, made / spent, best)


def test_adaptive_k_picks_the_best_chain_length():
    """With acceptance 0.6 and a verify cost linear in the block, E(k)/cost(k) peaks at a
    middle k: the planner settles there, not at K = 7."""
    spec = SpecConfig(mode="chain", num_draft_tokens=7, max_batch="auto", adaptive_k=True)
    planner = RoundPlanner.for_spec(spec)
    chosen = simulate(planner, 4, 80, cpu_like, accept=0.6)

    def rate(k):
        e = sum(0.6 ** i for i in range(k + 1))
        return e / cpu_like(4, k)

    best = max(range(8), key=rate)
    assert 1 < best < 7
    last = chosen[-20:]  # the nearest lengths are re-run often (cheap: they nearly tie)
    assert max(set(last), key=last.count) == best and last.count(best) >= 12, (best, chosen)
    alphas = planner.acceptance()
    assert alphas[0] == pytest.approx(0.6, abs=0.05)


def test_acceptance_counts_depths_reached_only():
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"), adaptive_k=True)
    planner.prior_weight = 0.0
    planner.observe(1, 3, 1.0, 0.3, [1, 2, 4, 3])  # accepted 0, 1, 3, 2 drafts
    assert planner._attempts[1:] == [4, 3, 2] and planner._accepts[1:] == [3, 2, 1]
    assert planner.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 2 / 3)


def test_a_burst_of_slow_rounds_does_not_lock_the_best_option_out():
    """While the machine is busy, the chain that runs measures slow (here the busy spell hits
    only the rounds that draft); the plain round then measured looks far better than the
    chain's cost. The chain is run again after reprobe_interval rounds, and judged on that fresh
    measurement (not on the busy ones among its last 5), so the planner returns to it."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    busy = set(range(10, 30))
    clock = iter(range(10**6))

    def cost(b, k):
        busy_now = next(clock) in busy
        return 1.0 if k == 0 else 1.2 * (3.0 if busy_now else 1.0)

    chosen = simulate(planner, 1, 300, cost, accept=0.6)
    assert chosen[:10].count(3) >= 7 and chosen[-50:].count(3) >= 45, chosen
    assert chosen[20:30] == [0] * 10, chosen  # the busy chain looked slower than plain
    ratio = (1 + 0.6 + 0.36 + 0.216) / 3.6  # the chain's busy cost against an idle plain round
    wait = planner.reprobe_interval(ratio)
    assert planner.reprobe < wait < 100
    back = next(i for i in range(30, 300) if chosen[i] == 3)
    assert back <= 30 + wait + 2, (back, chosen)
    assert chosen[back:back + 20].count(3) >= 18, chosen  # one fresh measurement is enough to stay


def test_reprobe_interval_grows_with_the_gap():
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"))
    """Proportional to the loss (each re-probe costs the same share of the time), reprobe
    rounds at the margin, never under reprobe_floor."""
    assert planner.reprobe_interval(planner.margin) == pytest.approx(planner.reprobe)
    assert planner.reprobe_interval(1 - 2 * (1 - planner.margin)) == pytest.approx(2 * planner.reprobe)
    assert planner.reprobe_interval(0.95) == pytest.approx(planner.reprobe / 3)
    assert planner.reprobe_interval(0.99) == planner.reprobe_interval(1.0) == planner.reprobe_floor
    assert planner.reprobe_interval(0.2) > planner.reprobe_interval(0.5)


def test_it_leaves_plain_rounds_only_for_a_clear_gain():
    """From plain rounds, a chain whose expected rate is within ``hold`` of plain's is not taken
    (on a noisy machine such near-ties flipped the choice back and forth, each switch paying a
    catch-up); a clear gain is."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    e3 = 1 + 0.6 + 0.36 + 0.216
    for gain, drafts in ((1.03, False), (1.25, True)):
        planner = RoundPlanner.for_spec(spec)
        cost = lambda b, k, g=gain: 1.0 if k == 0 else e3 / g  # noqa: E731
        chosen = simulate(planner, 8, 60, cost, accept=0.6)
        assert (chosen[10:].count(3) > 40) == drafts, (gain, chosen)


def test_a_slow_first_plain_round_is_measured_again():
    """Regression (batch 32): a call's first round measured far slower than plain rounds run
    (64 against 45-50 ms); with one measurement plain looked 30% behind a chain of one and was
    not run again in the call, while it was the faster choice. Plain rounds are re-run until
    they have ``confirm`` measurements, and then win."""
    spec = SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    plain_runs = iter(range(10**6))

    def cost(b, k):
        if k == 0:
            return 1.6 if next(plain_runs) == 0 else 1.0
        return 1.5  # E(1) = 1.45 at acceptance 0.45: 0.97 tokens per second against plain's 1.0

    chosen = simulate(planner, 32, 80, cost, accept=0.45)
    assert chosen[:2] == [0, 1], chosen
    assert chosen[20:].count(0) >= 48, chosen  # (a chain of one, 3% behind, is re-run every 7 rounds)
    assert len(planner._round_cost[(bucket(32), 1)].values) >= planner.confirm


def test_a_near_tie_goes_to_plain_rounds_while_drafting():
    """A chain that beats plain rounds by less than ``stay`` gains nothing a noisy machine can
    measure and pays its catch-ups: the planner leaves it for plain rounds; a chain ahead by
    more than ``hold`` is kept."""
    spec = SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto")
    for gain, drafts in ((1.02, False), (1.12, True)):
        planner = RoundPlanner.for_spec(spec)
        cost = lambda b, k, g=gain: 1.0 if k == 0 else 1.6 / g  # noqa: E731  (E(1) = 1.6)
        chosen = simulate(planner, 16, 60, cost, accept=0.6)
        assert chosen[:2] == [0, 1], chosen
        if drafts:
            assert chosen[10:].count(1) > 40, (gain, chosen)
        else:  # plain from the third round on, but for re-probes of the chain (one in 7 rounds)
            assert chosen[2] == 0 and chosen[2:].count(1) <= 58 // 7 + 1, (gain, chosen)


def test_the_trace_says_why_and_changes_nothing():
    """With ``trace`` a list, every round leaves a record: the same choices as without it, each
    with its reason (a new bucket's two probes, then plain by rate at 64 rows; a near chain re-run
    now and then at batch 1; a chain ahead of plain by less than ``hold`` left out as no clear
    gain), the rates compared, the measured seconds and emitted tokens; ``trace_summary`` counts
    them."""
    from rollout.engine.planner import BEST, NEW_BUCKET, NO_CLEAR_GAIN, REASONS, REPROBE, trace_summary

    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    e3 = 1 + 0.6 + 0.36 + 0.216
    near = lambda b, k: 1.0 if k == 0 else 1.95  # noqa: E731  (plain within margin of the chain)
    tie = lambda b, k: 1.0 if k == 0 else e3 / 1.03  # noqa: E731  (the chain 3% ahead of plain)
    for batch, cost, expect in ((64, cpu_like, BEST), (1, near, REPROBE), (8, tie, NO_CLEAR_GAIN)):
        plain_run = simulate(RoundPlanner.for_spec(spec), batch, 60, cost, accept=0.6)
        planner = RoundPlanner.for_spec(spec)
        planner.trace = []
        assert simulate(planner, batch, 60, cost, accept=0.6) == plain_run
        trace = planner.trace
        assert [r["k"] for r in trace] == plain_run and [r["round"] for r in trace] == list(range(1, 61))
        assert [r["why"] for r in trace[:2]] == [NEW_BUCKET, NEW_BUCKET] and trace[0]["rates"] == {}
        assert all(r["why"] in REASONS and r["batch"] == batch and r["call"] == 0 for r in trace)
        assert all(r["round_s"] == cost(batch, r["k"]) and len(r["emitted"]) == batch * (8 if r["k"] else 1)
                   for r in trace)  # (simulate splits a drafting round's rows eightfold)
        assert expect in {r["why"] for r in trace[2:]}, (batch, [r["why"] for r in trace])
        for r in trace[2:]:
            assert set(r["rates"]) == {"0", "3"}
            if r["why"] == BEST:
                assert str(r["k"]) == max(r["rates"], key=r["rates"].get)
            if r["why"] == NO_CLEAR_GAIN:
                assert r["k"] == 0 and r["rates"]["3"] > r["rates"]["0"]
        summary = trace_summary(trace)
        assert summary["rounds"] == 60
        assert sum(summary["plain"].values()) == plain_run.count(0)
        assert sum(summary["draft"].values()) == 60 - plain_run.count(0)
        assert summary["tokens"]["plain"] == batch * plain_run.count(0)
    planner.new_call()
    simulate(planner, 8, 2, tie, accept=0.6)
    assert [r["call"] for r in planner.trace[-2:]] == [1, 1]


def test_chains_shorter_than_the_best_are_not_run_again():
    """With adaptive K at batch 1 and a block that costs little more than a plain round, the
    longest chain is best; the shorter ones were measured on the way up, and the best chain's
    rounds keep measuring their acceptance: after the climb no round goes to them, while the
    plain round (the anchor) is still run again."""
    spec = SpecConfig(mode="chain", num_draft_tokens=6, max_batch="auto", adaptive_k=True)
    planner = RoundPlanner.for_spec(spec)
    cost = lambda b, k: 1.0 + 0.05 * k  # noqa: E731
    chosen = simulate(planner, 1, 300, cost, accept=0.8, draft=0.02)
    settled = chosen[60:]
    assert settled.count(6) >= len(settled) - 8, chosen
    assert not [k for k in settled if 0 < k < 6], chosen
    assert 0 in settled, chosen


def test_depths_not_yet_tried_borrow_the_mean_of_the_tried_ones():
    """alpha_j of a depth no round has reached is the pseudo-count estimate around the mean rate of
    the tried depths (not the fixed ``prior_accept``): chains of one draft accepted 9 times in 10
    make a chain of three look as good as that rate says."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"), adaptive_k=True)
    planner.observe(1, 1, 1.0, 0.1, [2] * 9 + [1])  # depth 1 tried 10 times, accepted 9; depths 2, 3 never
    rate = planner._accepts[1] / planner._attempts[1]
    assert rate == pytest.approx(0.9) and planner._attempts[2:] == [0, 0]
    alphas = planner.acceptance()
    w = planner.prior_weight
    assert alphas[0] == pytest.approx((9 + w * rate) / (10 + w))
    assert alphas[1:] == [pytest.approx(rate)] * 2
    assert planner.expected_tokens(3) == pytest.approx(1 + alphas[0] + alphas[0] * rate + alphas[0] * rate ** 2)


def test_a_bucket_without_its_own_draft_cost_borrows_the_nearest_smaller_one_on_a_tie():
    """``_nearest``: a bucket's own entry, else the nearest measured bucket's, the smaller one
    when two are as near (a draft step at batch 2 is a better guess for batch 4 than one at 16)."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"))
    table = {}
    for bk, seconds in ((1, 0.1), (3, 0.3), (5, 0.5)):
        table[bk] = Recent()
        table[bk].add(seconds)
    assert planner._nearest(table, 3).value == 0.3  # its own
    assert planner._nearest(table, 2).value == 0.1  # buckets 1 and 3 tie: the smaller
    assert planner._nearest(table, 4).value == 0.3  # 3 and 5 tie
    assert planner._nearest(table, 0).value == 0.1 and planner._nearest(table, 9).value == 0.5
    assert planner._nearest({}, 2) is None


def test_of_the_alternatives_due_again_the_nearest_runs_first(monkeypatch):
    """When several alternatives to the best option are due for a re-probe in the same round, the
    one whose expected rate is nearest the best's runs first (it is the likeliest to take over)."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"), adaptive_k=True)
    planner.trace = []
    planner._bucket_rounds[0] = 5
    planner._last_run.update({(0, 0): 1, (0, 1): 2})  # bucket 0 probed: not a new bucket
    rates = {0: 1.0, 1: 1.5, 2: 2.0, 3: 1.2}
    monkeypatch.setattr(planner, "rates", lambda b, switching=None: dict(rates))
    monkeypatch.setattr(planner, "_due", lambda b, k, ratio, best: k != best)
    assert planner.choose(1) == 1
    assert planner.trace[-1]["why"] == REPROBE
    rates[3] = 1.9
    assert planner.choose(1) == 3


def test_larger_options_open_one_at_a_time():
    """Only the next chain length above the measured ones is open to choice (its cost extrapolated
    from them): with chains of one measured at batch 1, the rates compare plain, 1 and 2, not 3."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"), adaptive_k=True)
    planner.observe(1, 0, 1.0, 0.0, [1])
    planner.observe(1, 1, 1.2, 0.1, [2])
    assert set(planner.rates(1)) == {0, 1, 2}
    planner.observe(1, 2, 1.4, 0.2, [3])
    assert set(planner.rates(1)) == {0, 1, 2, 3}


def test_the_acceptance_is_established_at_explore_row_rounds():
    """A probe's catch-up is charged once the acceptance rests on ``explore`` row-rounds of drafting
    (``_established``), counted from that many on, for chains (depth 1 attempts) and trees."""
    chain = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"))
    rows = int(chain.explore)
    chain.observe(rows - 1, 3, 1.0, 0.1, [1] * (rows - 1))
    assert not chain._established()
    chain.observe(1, 3, 1.0, 0.1, [4])
    assert chain._attempts[1] == chain.explore and chain._established()
    tree = RoundPlanner.for_spec(SpecConfig(mode="tree", depth=3, top_k=2, total_tokens=6, max_batch="auto"))
    tree.observe(rows, 1, 1.0, 0.1, [2] * rows)
    assert tree._tree[1] == tree.explore and tree._established()
