"""The round planner across switches, on synthetic costs and acceptance (deterministic; no models):
the catch-up a draft pays after plain rounds (the switch cost), later calls (costs kept, acceptance
discounted), and new batch buckets (their own rounds, deferred probes, the cost curve read)."""

from __future__ import annotations

import math

import pytest

from rollout.engine.planner import RoundPlanner, bucket
from rollout.params import SpecConfig
from tests.rollout.engine.planner_sim import cpu_like, kernel_like, simulate, spent


def test_a_catch_up_is_a_switch_cost_not_a_round_cost():
    """Drafting after plain rounds first runs the draft over every skipped pair: what that costs
    beyond a typical draft is the switch cost S, kept out of the option's round cost; after a
    plain round a speculative option carries S / horizon (the switch amortised)."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto"))
    planner.observe(8, 0, 1.0, 0.0, [1] * 8)
    planner.observe(8, 1, 1.0, 0.1, [2] * 8)  # a typical draft: 0.1 s per step
    planner.observe(8, 1, 1.0, 2.5, [2] * 8, catch_up=True)  # 2.4 s more than typical
    assert planner.round_cost(8, 2) == 1.0 and planner._draft_cost[bucket(8)].value == pytest.approx(0.1)
    assert planner.cost(8, 1) == pytest.approx(1.1)
    assert planner.cost(8, 1, switching=True) == pytest.approx(1.1 + 2.4 / planner.horizon)
    assert planner.cost(8, 0, switching=True) == 1.0  # a plain round never pays it
    e = planner.expected_tokens(1)
    assert planner.rates(8, switching=True)[1] == pytest.approx(e / (1.1 + 2.4 / planner.horizon))
    planner._drafting = True
    assert planner.rates(8)[1] == pytest.approx(e / 1.1)  # while drafting, nothing to switch


@pytest.mark.parametrize("adaptive", [False, True])
def test_it_keeps_drafting_at_batch_one_when_every_call_starts_with_a_catch_up(adaptive):
    """Regression: every call's first draft also runs the head over the prompt. Charged to the
    round cost, that made the chain of one draft (adaptive K's first probe, measured right after
    the first plain round) look slower than plain decoding for good: at batch 1 the engine then
    ran at 1.0x while a fixed chain ran at 1.4x (the adaptive case fails with that charge; the
    fixed one only just passed). Over several calls the planner drafts nearly every round and is within 5% of
    the best fixed chain."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto", adaptive_k=adaptive)
    planner = RoundPlanner.for_spec(spec)
    flat = lambda b, k: 1.0 + 0.03 * k  # noqa: E731  (batch 1: a block of k + 1 costs about one token)
    draft, switch, accept = 0.06, 0.6, 0.6
    made = took = 0.0
    for call in range(4):
        if call:
            planner.new_call()
        chosen = simulate(planner, 1, 40, flat, accept, draft, switch)
        assert chosen[2:].count(0) <= 2, (call, chosen)
        made += sum(sum(accept ** i for i in range(k + 1)) for k in chosen)
        took += spent(chosen, 1, flat, draft, switch)

    def fixed(k):  # tokens per second of a fixed chain of k over the same 4 calls of 40 rounds
        per_call = spent([k] * 40, 1, flat, draft, switch)
        return 40 * sum(accept ** i for i in range(k + 1)) / per_call

    assert made / took >= 0.95 * max(fixed(k) for k in (1, 2, 3)), (made / took, [fixed(k) for k in (1, 2, 3)])


def test_a_later_call_keeps_the_costs_and_discounts_the_acceptance():
    """``new_call``: the costs measured in earlier calls stay, so a later call does not probe
    again an option far behind; acceptance counts are scaled by ``carry`` (rates unchanged,
    weight halved), so the new call's own rounds soon dominate."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    first = simulate(planner, 64, 30, cpu_like, accept=0.6)
    assert first[:2] == [0, 3] and first[2:] == [0] * 28
    attempts, alphas = list(planner._attempts), planner.acceptance()
    planner.new_call()
    assert planner._attempts == [a * planner.carry for a in attempts]
    planner.prior_weight = 0.0
    assert planner.acceptance() == pytest.approx(alphas, abs=0.02)
    assert simulate(planner, 64, 30, cpu_like, accept=0.6) == [0] * 30  # no probe this time
    assert simulate(RoundPlanner.for_spec(spec), 64, 2, cpu_like, accept=0.6) == [0, 3]  # a fresh one probes
    # the acceptance of the new call takes over: after a call at 0.9, alpha is nearer 0.9 than 0.6
    small = RoundPlanner.for_spec(spec)
    simulate(small, 1, 40, cpu_like, accept=0.6)
    small.new_call()
    simulate(small, 1, 40, cpu_like, accept=0.9)
    assert small.acceptance()[0] > 0.75


def test_reprobes_count_the_buckets_own_rounds():
    """Rows finish during a call, so the small buckets see a few rounds per call. Counted in the
    planner's rounds, every option of such a bucket was due again at each visit (a plain round
    each call at batch 2, where the chain is 1.4x faster); counted in the bucket's rounds, plain
    is re-run there about once per ``reprobe_interval`` of its own rounds."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    cost = lambda b, k: 1.0 if k == 0 else (1.6 if b <= 2 else 5.0)  # noqa: E731  (E(3) = 2.18)
    tail = []
    for call in range(12):
        if call:
            planner.new_call()
        simulate(planner, 16, 40, cost, accept=0.6)
        tail += simulate(planner, 2, 3, cost, accept=0.6)
    visits = tail[2:]  # after the bucket's first plain round and probe
    ratio = 1.0 / (2.176 / 1.6)
    assert visits.count(0) <= len(visits) / planner.reprobe_interval(ratio) + 2, tail


def test_a_probe_from_plain_rounds_counts_its_catch_up():
    """Re-probing a chain from plain rounds costs its catch-up as well as its slower round: with a
    catch-up of three plain rounds the probes come less often than without one."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    cost = lambda b, k: 1.0 if k == 0 else 2.4  # noqa: E731  (0.91x plain: within margin)
    probes = {}
    for switch in (0.0, 3.0):
        planner = RoundPlanner.for_spec(spec)
        chosen = simulate(planner, 16, 400, cost, accept=0.6, switch=switch)
        probes[switch] = sum(1 for prev, k in zip(chosen[2:], chosen[3:]) if k and not prev)
    assert probes[0.0] >= 10 and probes[3.0] <= probes[0.0] / 3, probes


def test_a_new_larger_bucket_defers_a_probe_that_lost_at_a_smaller_batch():
    """At 16 rows the chain is far behind plain (kernel_like: a block of 4 tokens per row costs
    about 4 plain rounds); entering 32 rows, the planner does not open with a probe of it but
    waits reprobe_interval of that bucket's rounds. Where the chain wins at the smaller batch
    (4 rows), the new bucket (8 rows) probes it at once."""
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    planner = RoundPlanner.for_spec(spec)
    simulate(planner, 16, 30, kernel_like, accept=0.6)
    large = simulate(planner, 32, 120, kernel_like, accept=0.6)
    first = large.index(3)
    rates = planner.rates(16, switching=True)
    assert first >= planner.reprobe_interval(rates[3] / rates[0]) - 1, large
    assert large.count(3) <= 3, large
    small = RoundPlanner.for_spec(spec)
    simulate(small, 4, 30, cpu_like, accept=0.8)
    assert small.rates(4, switching=True)[3] > small.rates(4, switching=True)[0]
    assert simulate(small, 8, 2, cpu_like, accept=0.8) == [0, 3]


def test_one_unlucky_first_tree_round_does_not_keep_it_plain():
    """Regression: a fresh planner at batch 1 whose first tree round (its probe, with the prompt's
    catch-up) emitted one token had kept to plain rounds for 80 of a call's 90 rounds: every
    re-probe was charged that catch-up on an acceptance estimate from one round, and a tree's
    prior was one token plus prior_accept. Now a tree's prior is a chain as deep as the tree,
    and the catch-up is charged once ``explore`` row-rounds have drafted; either alone brings the
    tree (3 tokens a round for 1.6 plain rounds) back within a re-probe interval."""
    spec = SpecConfig(mode="tree", depth=3, top_k=4, total_tokens=8, max_batch="auto")
    assert RoundPlanner.for_spec(spec).expected_tokens(1) == pytest.approx(1 + 0.5 + 0.25 + 0.125)

    def run(planner):
        chosen, last = [], 0
        for _ in range(90):
            k = planner.choose(1)
            catch_up = k > 0 and last == 0
            emitted = [1] if k == 0 or not any(chosen) else [3]
            planner.observe(1, k, 1.0 if k == 0 else 1.45, 0.15 + (0.6 if catch_up else 0.0), emitted,
                            catch_up=catch_up)
            chosen.append(k)
            last = k
        return chosen

    old_prior = RoundPlanner.for_spec(spec)
    old_prior.expected_tokens = lambda k: 1.0 if k == 0 else (  # the former prior: 1 + prior_accept
        (old_prior._tree[0] + old_prior.prior_weight * 1.5) / (old_prior._tree[1] + old_prior.prior_weight))
    for planner in (RoundPlanner.for_spec(spec), old_prior):
        chosen = run(planner)
        assert chosen[:2] == [0, 1], chosen
        assert 1 in chosen[2:2 + planner.reprobe + 1], chosen
        assert chosen.count(1) >= 70, chosen


def test_a_new_bucket_reads_the_cost_curve_instead_of_probing():
    """As rows finish, a call moves to smaller buckets; the forward costs there were measured
    by the larger bucket's rounds (a chain of one over 16 rows runs 32 block rows, as a plain
    round over 32 rows did). The new bucket reads them off the cost curve: it does not probe
    a chain that the curve shows losing (each probe pays a catch-up over every row's skipped
    pairs), and drafts without a probe where the curve shows it winning."""
    spec = SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto")
    for per_row, drafts in ((0.03, False), (0.002, True)):
        planner = RoundPlanner.for_spec(spec)
        cost = lambda b, k, c=per_row: 0.1 + c * b * (k + 1)  # noqa: E731
        simulate(planner, 32, 30, cost, accept=0.6)
        assert planner._covered(16, 1) and not planner._covered(64, 1)
        chosen = simulate(planner, 16, 30, cost, accept=0.6)
        assert chosen[0] == 0, chosen  # a plain round first: the anchor of every bucket
        if drafts:
            assert chosen[1:].count(1) >= 25, chosen
        else:  # (12% behind: re-run after reprobe_interval rounds, as if measured at the bucket's start)
            wait = int(planner.reprobe_interval(0.88))
            assert chosen[1:wait] == [0] * (wait - 1) and chosen.count(1) <= 2, chosen


def test_a_switch_is_amortised_over_the_rounds_the_call_has_left():
    """Late in a call a catch-up cannot be spread over ``horizon`` rounds that will not run: with
    the live rows' largest remaining budget passed in, a speculative option after plain rounds
    carries S / ceil(remaining / E(k)), and a switch that only pays over 24 rounds is not made for
    the last few tokens (the plain round is chosen), while with budget to spare it is."""
    planner = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto"))
    for _ in range(3):
        planner.observe(8, 0, 1.0, 0.0, [1] * 8)
    planner.observe(8, 1, 1.0, 0.1, [2] * 8)  # a chain of one accepted every time: E(1) near 2
    planner.observe(8, 1, 1.0, 2.5, [2] * 8, catch_up=True)  # switch cost 2.4 s
    planner._drafting = False
    e = planner.expected_tokens(1)
    assert planner.switch_rounds(1) == planner.horizon  # nothing known of the call's end
    planner.choose(8, remaining=4)
    assert planner.switch_rounds(1) == math.ceil(4 / e)
    assert planner.cost(8, 1, switching=True) == pytest.approx(1.1 + 2.4 / math.ceil(4 / e))
    planner.choose(8, remaining=1000)
    assert planner.switch_rounds(1) == planner.horizon

    def choice(remaining):
        p = RoundPlanner.for_spec(SpecConfig(mode="chain", num_draft_tokens=1, max_batch="auto"))
        for _ in range(3):
            p.observe(8, 0, 1.0, 0.0, [1] * 8)
        p.observe(8, 1, 1.0, 0.1, [2] * 8)
        p.observe(8, 1, 1.0, 2.5, [2] * 8, catch_up=True)
        p._last_run = {(bucket(8), 0): 0, (bucket(8), 1): 0}
        p._bucket_rounds = {bucket(8): 1}
        p._drafting = False
        return p.choose(8, remaining=remaining)

    assert choice(1000) == 1  # E(1) / (1.1 + 0.1) >> 1: drafting pays
    assert choice(3) == 0  # over 2 rounds the 2.4 s catch-up costs more than drafting gains
