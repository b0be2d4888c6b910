"""Per-round speculation planner (``spec.max_batch: auto``, ``spec.adaptive_k``).

Each round the engine asks :meth:`RoundPlanner.choose` how many tokens to draft: 0 is a
plain round (one target forward over the pending token; the draft catches up later, see
``rollout.engine.runner``), k >= 1 a speculative round (a chain of k drafts, or the configured
tree). The planner decides from what it measured in this call and, when the engine keeps
it (:class:`rollout.engine.engine.Engine` keeps one per speculation, verifier and sampling setting),
in its earlier calls (:meth:`RoundPlanner.new_call`):

- **round cost** ``R(b, n)``: seconds of a round without its drafting, over ``b`` live rows
  with ``n`` block tokens per row (1 for a plain round, k + 1 for a chain of k). Rounds are
  grouped by batch bucket (1, 2, 3-4, 5-8, ...). Per bucket and n the planner keeps the
  median of the last 5 measurements and of the live rows they ran over, a point (b x n
  block rows, seconds). A round's cost follows its block rows, whatever the bucket (a plain
  round over 32 rows and a chain of one over 16 run forwards of 32 rows), so the points of
  every bucket make one cost curve, made non-decreasing by pooling adjacent points that
  disagree (a forward never gets cheaper with more rows); ``R(b, n)`` is that curve read at
  b x n rows, linear between its points (beyond them: along the nearest segment). Within a
  bucket the rows change (from 16 to 9 as rows of a batch of 16 finish), and from about 16
  rows a forward's cost grows with them: comparing a plain round measured at 16 rows with a
  chain measured at 10 as if both ran at the same batch had made drafting look 1.5x better
  than plain at batch 16, where it loses. And a line through one bucket's two points, one
  measured in a busy second and one in a quiet one, had read a chain of one over 20 rows
  (40 block rows) as cheaper than a plain round over the same 20 rows (batch 32, lossless:
  the planner drafted at 0.8-0.9x plain decoding). With one block size measured, R is that
  point for its n and unknown for the others. (The recent values and the curve are pure
  functions in :mod:`rollout.engine.planner_costs`.)
- **draft cost** ``D(b)``: seconds per draft step (rounds that catch up on skipped pairs
  are not counted: their step 0 is longer). A bucket without its own measurement uses the
  nearest bucket's (as for ``S``).
- **switch cost** ``S(b)``: what a catch-up costs beyond a typical draft (the draft runs over
  the pairs of the rounds it skipped, or over the prompt in a call's first draft). It is paid
  once when drafting resumes, not every round, so it stays out of ``R`` (charging it to the
  round that paid it made an option measured only right after plain rounds look slow for
  good: at batch 1 with adaptive K the planner then kept to plain rounds at 1.0x while a
  fixed chain ran at 1.4x). From a plain round, a speculative option's cost carries
  ``S(b) / horizon``: the switch is amortised over the ``horizon`` rounds (default 24, the
  re-probe interval) it is expected to run, so a re-probe that barely wins is not made into
  a loss; but never over more rounds than the call has left: when the engine passes the
  largest token budget its live rows have left (``choose(b, remaining=...)``), the option
  runs at most ``ceil(remaining / E(k))`` rounds, and the catch-up is spread over those (late in
  a call, as rows finish and the batch drops to sizes where drafting pays, a switch after a
  long run of plain rounds catches up over every skipped pair for the few rounds that are left).
- **acceptance**: for chains, the conditional acceptance rate at each draft depth j,
  alpha_j = P(draft j accepted | drafts 1..j-1 accepted), pooled over rows and rounds; a
  chain of k then emits E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j tokens per row. Depths
  not yet tried borrow the mean of the tried ones (pseudo-counts). For trees, the mean
  tokens emitted per row per tree round (prior: a chain as deep as the tree).

It picks the option with the most expected tokens per second, E(k) / (R(b, k+1) + k D(b)
[+ S(b) / horizon after a plain round]) against 1 / R(b, 1), but drafts only for a clear gain:
after a plain round a speculative option must beat plain by ``hold`` (default 8%), and while
drafting it keeps drafting only while the best option beats plain by ``stay`` (4%). On this
shared machine the median of 5 plain rounds wanders by +-15% from second to second, and
near-ties had flipped the choice back and forth, each flip paying a catch-up (at batch 16,
where a chain loses, ``auto`` ran at 0.83-0.90x plain decoding); a chain that only ties plain
gains nothing and costs its catch-ups, so a near-tie goes to plain rounds, the choice that is
never slower than plain decoding. Plain rounds are that anchor, so their cost is confirmed: a
bucket's plain round is run again (every ``reprobe_floor`` rounds) until it has ``confirm``
(3) measurements, whatever the gap (a call's first round measured 64 ms at 32 rows where
plain rounds take 45-50, and one such measurement had kept plain rounds out of a whole call).
In a new bucket it first measures a plain round and the cheapest speculative option (a chain
of one draft with adaptive K, else the configured one), unless the cost curve already has
measured points on both sides of that option's block rows: as rows finish, a call moves down
to smaller buckets whose forwards the larger bucket's rounds have measured, and a probe there
pays a catch-up over every row's skipped pairs (an option the curve covers counts as measured
when the bucket began, for its re-probes). Larger options open one at a time: the next one's cost is
extrapolated from the measured ones, and when it looks better it is tried, and so measured,
by being chosen. A new bucket's first speculative probe waits (as a re-probe would) when the
nearest smaller bucket found that option more than ``margin`` behind plain: the block only gets
dearer with more rows, and at 32 rows a probe with its catch-up over the prompts costs several
plain rounds. Probes stay cheap: a large option is only tried when the one below it pays.
An alternative to the current best is run again after an interval proportional to its
expected loss against the best (``reprobe`` rounds at a gap of ``margin``, at least
``reprobe_floor``; ``reprobe_interval``): a lasting change of machine load can turn the choice,
and every re-probe then costs the same small share of the time, so that a noisy measurement
cannot lock an option out for good (on this shared machine a few slow rounds had made the best
chain length look 35% slower for the rest of the calls). Chains shorter than the best one are
the exception: its rounds measure their acceptance, and while the cost curve has points on both
sides of their block rows they are not run again. A probe's loss is its gap plus, for a
speculative probe from plain rounds, its catch-up (``S(b)`` in rounds of the best option), once
the acceptance rests on ``explore`` row-rounds of drafting: a costly catch-up spaces the probes
further. Intervals count the bucket's own rounds: rows finish during a call, so the small
buckets see a few rounds per call, and counted in all rounds every option there was due again
at each visit. Each cost is judged on its measurements of the 48 rounds before its newest one.

Why it chose what it chose: with ``trace`` set to a list (``Engine.trace_plans``, ``bench_rollout
--planner-trace``), every round appends a record: ``call`` (numbered from 0 by ``new_call``),
``round``, ``batch``, ``k``, ``why`` (``REASONS``), ``rates`` (the expected tokens per second per
row of each option compared, keyed by k as text; empty in a new bucket), then ``round_s``,
``draft_s``, ``emitted`` (per row) and ``catch_up`` as ``observe`` got them (written by
:mod:`rollout.engine.planner_trace`). :func:`trace_summary` counts the rounds by choice and reason. The
records grow by one per round: for diagnosis, not for a long training run.

Across calls: the costs stay (they are properties of the machine, the model and the batch
size; the last 5 rounds of each decide, so a change of load still shows within a few rounds),
so later calls do not pay the probes again; the acceptance counts are scaled down at each
new call (``carry``, default 0.5: a call's own rounds soon outweigh earlier ones, as the
prompts and the policy change between calls).

Exactness: every round, plain or speculative, emits tokens from the right conditional
distribution given the tokens before (lossless: p; lossy: the rule's induced distribution,
whose log-probs are reported), and the choice depends only on the past, so switching
keeps outputs exact. The choice depends on wall-clock times, though: with ``auto`` a
seeded call is exact but not bit-reproducible across runs (nor across calls, as the planner
learns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rollout.engine.planner_costs import Recent, covers, pooled_curve, read_curve
from rollout.engine.planner_trace import BEST, NEW_BUCKET, NO_CLEAR_GAIN, REPROBE, record_choice, record_measured
from rollout.engine.planner_trace import REASONS, trace_summary  # noqa: F401  (re-exported: scripts, tests)


def bucket(batch: int) -> int:
    """Batch bucket: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    assert batch >= 1, batch
    return (batch - 1).bit_length()


@dataclass
class RoundPlanner:
    """Chooses the draft length of each round (0 = plain). ``options``: the speculative
    choices (chain lengths 1..K with adaptive K, else just K; a tree is option 1);
    ``block_tokens[k]``: block tokens per row of option k; ``draft_steps[k]``: draft forwards
    of option k; ``chain``: acceptance is tracked per depth (else as mean tokens per round)."""

    options: list[int]
    block_tokens: dict[int, int]
    draft_steps: dict[int, int]
    chain: bool = True
    reprobe: int = 24
    reprobe_floor: float = 6.0
    margin: float = 0.85
    prior_accept: float = 0.5
    prior_weight: float = 4.0
    carry: float = 0.5
    horizon: int = 24
    hold: float = 0.08
    stay: float = 0.04
    confirm: int = 3
    explore: float = 8.0
    _round_cost: dict[tuple[int, int], Recent] = field(default_factory=dict)
    _round_rows: dict[tuple[int, int], Recent] = field(default_factory=dict)  # live rows of those rounds
    _draft_cost: dict[int, Recent] = field(default_factory=dict)
    _switch_cost: dict[int, Recent] = field(default_factory=dict)  # per bucket: a catch-up beyond a draft
    _drafting: bool = False  # the last round drafted (else the next draft catches up)
    _attempts: list[float] = field(default_factory=list)  # per depth (decayed counts across calls)
    _accepts: list[float] = field(default_factory=list)
    _tree: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, row-rounds
    _last_run: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, k) -> the bucket's round
    _bucket_rounds: dict[int, int] = field(default_factory=dict)  # rounds run per bucket
    _round: int = 0
    _curve_memo: tuple | None = None  # (_curve(),) until the next observed round
    _calls: int = 0  # calls started (new_call)
    _remaining: int | None = None  # the largest token budget a live row has left (choose's remaining)
    trace: list[dict] | None = None  # when a list: a record per round (see the module docstring)

    def __post_init__(self) -> None:
        assert self.options and min(self.options) >= 1, self.options
        depth = max(self.options) + 1
        self._attempts, self._accepts = [0.0] * depth, [0.0] * depth

    def new_call(self) -> None:
        """Start another call with what earlier calls measured: costs kept, acceptance counts
        scaled by ``carry`` (see the module docstring)."""
        self._attempts = [a * self.carry for a in self._attempts]
        self._accepts = [a * self.carry for a in self._accepts]
        self._tree = [x * self.carry for x in self._tree]
        self._drafting = False  # a call's first draft consumes its prompt
        self._calls += 1

    @classmethod
    def for_spec(cls, spec, adaptive_k: bool | None = None) -> RoundPlanner:
        if spec.mode == "chain":
            k = spec.num_draft_tokens
            adaptive = spec.adaptive_k if adaptive_k is None else adaptive_k
            opts = list(range(1, k + 1)) if adaptive else [k]
            return cls(opts, {o: o + 1 for o in opts}, {o: o for o in opts}, chain=True)
        return cls([1], {1: spec.total_tokens + 1}, {1: spec.depth}, chain=False)

    # ------------------------------------------------------------------ model
    def acceptance(self) -> list[float]:
        """alpha_1..alpha_K (see the module docstring)."""
        tried = [self._accepts[j] / self._attempts[j] for j in range(1, len(self._attempts)) if self._attempts[j]]
        prior = sum(tried) / len(tried) if tried else self.prior_accept
        w = self.prior_weight
        return [(self._accepts[j] + w * prior) / (self._attempts[j] + w) for j in range(1, len(self._attempts))]

    def expected_tokens(self, k: int) -> float:
        """Expected tokens per row of option k (1 for a plain round)."""
        if k == 0:
            return 1.0
        if not self.chain:  # prior: a chain as deep as the tree, each draft accepted at prior_accept
            tokens, rounds = self._tree
            w = self.prior_weight
            prior = sum(self.prior_accept ** i for i in range(self.draft_steps[k] + 1))
            return (tokens + w * prior) / (rounds + w)
        out, run = 1.0, 1.0
        for a in self.acceptance()[:k]:
            run *= a
            out += run
        return out

    def round_cost(self, b: int, n: int) -> float | None:
        """R(b, n): the cost curve of a round over its block rows (:meth:`_curve`) read at b x n,
        linear between its points (beyond them: along the nearest segment); before two block
        sizes are measured, a measured (bucket, n) stands for itself."""
        curve = self._curve()
        if curve is None:
            e = self._round_cost.get((bucket(b), n))
            return e.value if e is not None else None
        return read_curve(curve, b * n)

    def _curve(self) -> list[tuple[float, float]] | None:
        """The points (median block rows, median seconds) of every bucket and block size as one
        non-decreasing curve (``planner_costs.pooled_curve``); kept until the next observed round."""
        if self._curve_memo is None:
            self._curve_memo = (pooled_curve([(self._round_rows[key].value * key[1], e.value)
                                              for key, e in self._round_cost.items()]),)
        return self._curve_memo[0]

    def cost(self, b: int, k: int, switching: bool = False) -> float | None:
        """Expected seconds of a round of option k over b rows (None: not measurable yet);
        ``switching``: the round follows a plain one (a speculative option then carries its
        share of the switch cost, see the module docstring)."""
        r = self.round_cost(b, self.block_tokens[k] if k else 1)
        if r is None or not k:
            return r
        d, sw = self._nearest(self._draft_cost, bucket(b)), self._nearest(self._switch_cost, bucket(b))
        extra = sw.value / self.switch_rounds(k) if switching and sw is not None else 0.0
        return r + (self.draft_steps[k] * d.value if d is not None else 0.0) + extra

    def switch_rounds(self, k: int) -> int:
        """Rounds over which a switch to option k is amortised: ``horizon``, or fewer when the
        call's live rows have fewer tokens left than k's expected rounds would emit in them."""
        if self._remaining is None:
            return self.horizon
        return max(1, min(self.horizon, math.ceil(self._remaining / self.expected_tokens(k))))

    # ------------------------------------------------------------------ decide / learn
    def rates(self, b: int, switching: bool | None = None) -> dict[int, float]:
        """Expected tokens per second of the options open to choice (0 = plain): the ones
        measured in b's bucket and the next larger one (its cost extrapolated); ``switching``
        (default: the last round was plain) charges the switch cost (:meth:`cost`). Larger
        options open one at a time, as they are measured: a forward's cost bends with its size
        (flat while the kernel reads the weights, then growing with the rows), which a line
        through smaller blocks does not see far ahead."""
        bk = bucket(b)
        measured = [k for k in self.options if (bk, self.block_tokens[k]) in self._round_cost or self._covered(b, k)]
        above = [k for k in self.options if k > max(measured, default=0)]
        switching = not self._drafting if switching is None else switching
        out = {}
        for k in (0, *measured, *above[:1]):
            c = self.cost(b, k, switching)
            if c is not None:
                out[k] = self.expected_tokens(k) / c
        return out

    def choose(self, b: int, remaining: int | None = None) -> int:
        """Draft length of the next round over ``b`` live rows (0 = plain); ``remaining``: the
        largest token budget a live row has left (None: unknown; see ``switch_rounds``)."""
        self._round += 1
        self._remaining = remaining
        k, why, rates = self._choose(b)
        if self.trace is not None:
            record_choice(self.trace, self._calls, self._round, b, k, why, rates)
        return k

    def _choose(self, b: int) -> tuple[int, str, dict[int, float]]:
        """The choice, why (one of ``REASONS``) and the rates compared (none in a new bucket)."""
        bk = bucket(b)
        self._bucket_rounds[bk] = self._bucket_rounds.get(bk, 0) + 1
        for k in (0, min(self.options)):  # in a new bucket: a plain round, then the cheapest draft
            if (bk, k) not in self._last_run and not (k and (self._covered(b, k) or self._deferred(bk, k))):
                return self._mark(bk, k), NEW_BUCKET, {}
        rates = self.rates(b)
        best = max(rates, key=lambda k: rates[k])
        why = BEST
        if best and 0 in rates and rates[best] < (1 + (self.stay if self._drafting else self.hold)) * rates[0]:
            # draft only for a clear gain (measurement noise must not flip it, nor cost)
            best, why = 0, NO_CLEAR_GAIN
        due = [k for k in rates if k != best and self._due(b, k, rates[k] / rates[best], best)]
        if due:  # keep the alternatives' measurements fresh (the nearest first)
            return self._mark(bk, max(due, key=lambda k: rates[k])), REPROBE, rates
        return self._mark(bk, best), why, rates

    def _covered(self, b: int, k: int) -> bool:
        """Whether the cost curve has measured points on both sides of option k's block rows at
        b rows (its cost is read between them, not extrapolated): then other buckets' rounds
        have measured it, and a new bucket need not probe it (a probe from plain rounds pays a
        catch-up over every row's skipped pairs)."""
        return covers(self._curve(), b * (self.block_tokens[k] if k else 1))

    def _deferred(self, bk: int, k: int) -> bool:
        """Whether the first probe of option k in bucket ``bk`` waits: when the nearest smaller
        bucket measured both, k was further than ``margin`` behind plain there, and a larger
        batch only makes a block dearer against a plain round (on a CPU a forward's cost grows
        with its rows), the probe (a catch-up over every row's prompt and a block of k + 1
        tokens per row) waits ``reprobe_interval`` of the bucket's rounds, as a re-probe would."""
        n = self.block_tokens[k]
        for small in range(bk - 1, -1, -1):
            if (small, 1) in self._round_cost and (small, n) in self._round_cost:
                b = max(1, round(self._round_rows[(small, 1)].value))
                rates = self.rates(b, switching=True)
                if 0 not in rates or k not in rates:
                    return False
                ratio = rates[k] / rates[0]
                return ratio < self.margin and self._bucket_rounds[bk] <= self.reprobe_interval(ratio)
        return False

    def _due(self, b: int, k: int, ratio: float, best: int) -> bool:
        """Whether option k (expected rate ``ratio`` times the best's) is to be run again; one
        never run in the bucket (its cost extrapolated) only when within ``margin``. Intervals
        count the bucket's own rounds (a bucket visited for a few rounds per call, as rows
        finish, is not re-probed at each visit), and a speculative probe from plain rounds also
        loses its catch-up (the switch cost, in rounds of the best option). A chain shorter than
        the best one is not run again while the cost curve covers its block rows: the best chain's
        rounds try every depth it has, so they measure its acceptance, and its cost is read between
        measured points (re-running chains of 3-4 at batch 1, where chains of 3-6 nearly tie, had
        made a third of the rounds re-probes)."""
        bk = bucket(b)
        if self.chain and 0 < k < best and self._covered(b, k):
            return False  # what it would measure, the longer chain's rounds measure (see below)
        last = self._last_run.get((bk, k))
        if last is None and not self._covered(b, k):
            return ratio >= self.margin
        last = last or 0  # an option the cost curve covers counts as measured when the bucket began
        plain = None if k else self._round_cost.get((bk, 1))
        if plain is not None and len(plain.values) < self.confirm:  # plain, the anchor: confirmed
            return self._bucket_rounds[bk] - last > self.reprobe_floor
        loss = 1.0 - ratio
        switch = self._nearest(self._switch_cost, bk)
        if k and not self._drafting and switch is not None and self._established():
            loss += switch.value / max(1e-9, self.cost(b, best) or 0.0)
        return self._bucket_rounds[bk] - last > self.reprobe_interval(1.0 - loss)

    def reprobe_interval(self, ratio: float) -> float:
        """Rounds between re-runs of an option whose expected rate is ``ratio`` times the best's
        (its loss is 1 - ratio of a round): proportional to the loss, ``reprobe`` rounds at the
        ``margin`` (a loss of 1 - margin), so that every re-probe costs the same small share of
        the time, (1 - margin) / reprobe of a round per round (0.6%); at least ``reprobe_floor``
        rounds. A far option is still re-run now and then, so a noisy measurement cannot lock it
        out for good; a near one is re-run often, as that costs next to nothing: with 24 rounds
        for every option within ``margin``, a chain length measured once in a slow spell stayed
        out for 24 rounds, and adaptive K at batch 1 ran at 1.33x our autoregressive mode
        against fixed K = 3's 1.45x (lossless; 1.46x with these intervals, in the same run)."""
        return max(self.reprobe_floor, self.reprobe * (1.0 - ratio) / (1.0 - self.margin))

    def _established(self) -> bool:
        """Whether the acceptance rests on ``explore`` row-rounds of drafting (decayed counts):
        before that a probe's catch-up is not charged, as the estimate may be one unlucky round
        (a fresh planner whose first tree emitted one token on a hard prompt, then charged the
        prompt's catch-up to every probe, had kept to plain rounds for 80 of a call's 90 rounds
        at batch 1, where the tree runs at 1.7x)."""
        seen = self._tree[1] if not self.chain else self._attempts[1]
        return seen >= self.explore

    @staticmethod
    def _nearest(table: dict[int, Recent], bk: int) -> Recent | None:
        """The bucket's own entry, else the nearest measured bucket's (the smaller one on a tie):
        a draft step or a catch-up measured at a neighbouring batch size is a better guess than
        none (probes that are always single rounds after plain ones never measure a typical draft
        in their bucket)."""
        if bk in table:
            return table[bk]
        near = min(table, key=lambda x: (abs(x - bk), x), default=None)
        return table[near] if near is not None else None

    def _mark(self, bk: int, k: int) -> int:
        self._last_run[(bk, k)] = self._bucket_rounds[bk]
        self._drafting = k > 0
        return k

    def observe(self, b: int, k: int, round_s: float, draft_s: float, emitted: list[int],
                catch_up: bool = False) -> None:
        """Record a round of option ``k`` over ``b`` rows: its seconds without drafting and of
        drafting, and the tokens each row emitted (before stop/length truncation).
        ``catch_up``: the draft consumed pairs of skipped rounds or the prompt (its draft cost is
        not typical: what it costs beyond a typical draft is the switch cost)."""
        bk = bucket(b)
        n = self.block_tokens[k] if k else 1
        record_measured(self.trace, self._round, round_s, draft_s, emitted, catch_up)
        self._curve_memo = None
        self._round_cost.setdefault((bk, n), Recent()).add(max(round_s, 1e-9), self._round)
        self._round_rows.setdefault((bk, n), Recent()).add(float(b), self._round)
        if k == 0:
            return
        typical = self._nearest(self._draft_cost, bk)
        if not catch_up:
            self._draft_cost.setdefault(bk, Recent()).add(draft_s / self.draft_steps[k], self._round)
        else:  # (before any typical draft is measured, the whole draft counts: an upper bound)
            extra = max(0.0, draft_s - (self.draft_steps[k] * typical.value if typical is not None else 0.0))
            self._switch_cost.setdefault(bk, Recent()).add(extra, self._round)
        if not self.chain:
            self._tree[0] += sum(emitted)
            self._tree[1] += len(emitted)
            return
        for e in emitted:
            accepted = min(e - 1, k)
            for j in range(1, min(accepted + 1, k) + 1):  # depth j was tried when j - 1 were accepted
                self._attempts[j] += 1
                self._accepts[j] += j <= accepted
