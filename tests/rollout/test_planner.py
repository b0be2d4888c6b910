"""The round planner on synthetic costs and acceptance (deterministic; no models)."""

from __future__ import annotations

import pytest

from rollout.params import SpecConfig
from rollout.planner import RoundPlanner, bucket


def simulate(planner: RoundPlanner, batch: int, rounds: int, cost, accept: float, draft: float = 0.0,
             switch: float = 0.0) -> list[int]:
    """Run ``rounds`` rounds (one call) over ``batch`` rows: option k costs ``cost(batch, k)``
    seconds without drafting and ``k * draft`` drafting, plus ``switch`` when it drafts after a
    plain round or first in the call (the catch-up); every row accepts each draft with
    probability ``accept`` (the planner sees the expected counts, deterministically)."""
    chosen = []
    last = 0  # before the first round: the prefill (the first draft runs over the prompt)
    for _ in range(rounds):
        k = planner.choose(batch)
        chosen.append(k)
        if k == 0:
            emitted = [1] * batch
        else:  # rows split so that depth j is reached with the geometric frequencies
            emitted = []
            for r in range(batch * 8):
                u = (r + 0.5) / (batch * 8)
                a = 0
                while a < k and u < accept ** (a + 1):
                    a += 1
                emitted.append(a + 1)
        catch_up = k > 0 and last == 0
        planner.observe(batch, k, cost(batch, k), k * draft + (switch if catch_up else 0.0), emitted,
                        catch_up=catch_up)
        last = k
    return chosen


def spent(chosen: list[int], batch: int, cost, draft: float, switch: float) -> float:
    """Seconds the rounds of ``simulate`` took."""
    return sum(cost(batch, k) + k * draft + (switch if k and prev == 0 else 0.0)
               for prev, k in zip([0, *chosen], chosen))


def cpu_like(b: int, k: int) -> float:
    """A forward's cost grows with its tokens once the batch has rows: b * (k + 1) tokens."""
    return 1.0 + 0.08 * b * (k + 1)


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


def kernel_like(b: int, k: int) -> float:
    """Costs shaped like the engine's on this CPU: nearly flat up to about 16 rows in a forward
    (the native kernel reads the weights once), then growing with the rows (bound by FMAs)."""
    rows = b * (k + 1)
    return 1.0 + 0.02 * rows + 0.07 * max(0, rows - 16)


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


def test_the_trace_says_why_and_changes_nothing():
    """With ``trace`` a list, every round leaves a record: the same choices as without it, each
    with its reason (a new bucket's two probes, then plain by rate at 64 rows; a near chain re-run
    now and then at batch 1; a chain ahead of plain by less than ``hold`` left out as no clear
    gain), the rates compared, the measured seconds and emitted tokens; ``trace_summary`` counts
    them."""
    from rollout.planner import BEST, NEW_BUCKET, NO_CLEAR_GAIN, REASONS, REPROBE, trace_summary

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
