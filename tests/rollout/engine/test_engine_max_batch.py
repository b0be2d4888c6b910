"""spec.max_batch: rounds over more rows than max_batch decode plainly and the draft catches up
on their tokens later; outputs stay exact (greedy = autoregressive, log-probs = closed form)."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

from rollout.config import ConfigError
from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.params import SamplingParams, SpecConfig, VerifierConfig


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target()
    return target, trained_head(target, draft_vocab=48)


def _plain_round(runner: ModelRunner) -> None:
    """One greedy autoregressive round through the runner, as the engine's plain rounds do."""
    b = runner.batch
    logits, feats = runner.verify_forward(runner.pending[:, None], torch.zeros(1, 1, dtype=torch.long), None)
    tokens = logits[:, 0].argmax(-1, keepdim=True)
    runner.commit(torch.ones(b, dtype=torch.long), [1] * b, tokens, feats, None)


def test_draft_catches_up_on_skipped_rounds_exactly(models):
    """Skipping draft step 0 for several rounds (and dropping a row meanwhile), then consuming
    everything at once, leaves the draft exactly where consuming each round would."""
    target, head = models
    outs = []
    for catch_up in (False, True):
        runner = ModelRunner(target, head)
        first = runner.start(PROMPTS, capacity=64).argmax(-1)
        runner.set_first_tokens(first)
        for r in range(5):
            if not catch_up:
                runner.draft_root()
            _plain_round(runner)
            if r == 2:
                runner.keep([0, 2, 3])
        root = runner.draft_root()
        logits, hidden = root.logits, root.hidden
        lengths = runner.draft_kv.lengths.clone()
        keys = [runner.draft_kv.keys[0][i, :, :n] for i, n in enumerate(lengths.tolist())]
        outs.append((logits, hidden, lengths, keys))
    (l0, h0, n0, k0), (l1, h1, n1, k1) = outs
    assert n0.tolist() == n1.tolist() == [len(PROMPTS[i]) + 5 for i in (0, 2, 3)]
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    for a, b in zip(k0, k1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def _stop_token(engine, sampling) -> int:
    """A token that ends some greedy completions early (so the batch shrinks mid-call)."""
    ref = engine.generate(PROMPTS, sampling, SpecConfig(mode="off"))
    return ref.completions[0].completion_ids[6]


@pytest.mark.parametrize("spec", [
    SpecConfig(mode="chain", num_draft_tokens=3, max_batch=3),
    SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy", max_batch=3),
    SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, max_batch=3),
], ids=["chain-sampled", "chain-greedy", "tree"])
def test_greedy_with_max_batch_equals_autoregressive(models, spec):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    stop = _stop_token(engine, SamplingParams(temperature=0, max_new_tokens=40))
    sampling = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,))
    ref = engine.generate(PROMPTS, sampling, SpecConfig(mode="off"))
    lengths = [c.num_tokens for c in ref.completions]
    assert len(set(lengths)) > 1, "the stop token should end rows at different lengths"
    res = engine.generate(PROMPTS, sampling, spec)
    for a, b in zip(ref.completions, res.completions):
        assert b.completion_ids == a.completion_ids
    t = res.timings
    assert 0 < t.plain_rounds < t.rounds, "both plain and drafting rounds should run"
    assert t.draft_tau > 1.2, "the draft should be in sync after catching up"


def test_max_batch_behaviour_logprobs_match_the_closed_form(models):
    """T = 1 under a lossy rule: every token's behaviour log-prob is log p in plain rounds
    and the rule's induced log-prob in drafting rounds (the debug records hold the inputs)."""
    from test_engine_utils import induced_logprob

    target, head = models
    rule_cfg = VerifierConfig("mars", {"theta": 0.5})
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=tuple(range(0, 64, 16)))
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch=3)
    res = Engine(target, head, num_threads=1).generate(PROMPTS * 2, sampling, spec, rule_cfg, seed=3, debug=True)
    assert 0 < res.timings.plain_rounds < res.timings.rounds
    rule = rule_cfg.rule()
    checked = 0
    for rec in res.debug:
        comp = res.completions[rec.row]
        assert comp.behaviour_logprobs[rec.index] == pytest.approx(induced_logprob(rule, rec, sampling), abs=1e-4)
        checked += 1
    assert checked == sum(c.num_tokens for c in res.completions)


def test_max_batch_validation():
    with pytest.raises(ConfigError, match="'max_batch'"):
        SpecConfig(max_batch=0)
    spec = SpecConfig(max_batch=4)
    assert spec.drafts_at(4) and not spec.drafts_at(5)
    assert SpecConfig().drafts_at(1000) and not SpecConfig(mode="off").drafts_at(1)


# ---------------------------------------------------------------- max_batch: auto (rollout.engine.planner)

AUTO_SPECS = [
    SpecConfig(mode="chain", num_draft_tokens=4, max_batch="auto", adaptive_k=True),
    SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy", max_batch="auto", adaptive_k=True),
    SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, max_batch="auto"),
]


@pytest.fixture()
def fast_reprobe(monkeypatch):
    """Re-probe every few rounds so that short calls switch between plain rounds and several
    chain lengths many times."""
    from rollout.engine.planner import RoundPlanner

    monkeypatch.setattr(RoundPlanner, "reprobe", 3)


@pytest.mark.parametrize("spec", AUTO_SPECS, ids=["chain-sampled", "chain-greedy", "tree"])
def test_greedy_with_auto_equals_autoregressive(models, spec, fast_reprobe):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    stop = _stop_token(engine, SamplingParams(temperature=0, max_new_tokens=40))
    sampling = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,))
    ref = engine.generate(PROMPTS, sampling, SpecConfig(mode="off"))
    res = engine.generate(PROMPTS, sampling, spec)
    for a, b in zip(ref.completions, res.completions):
        assert b.completion_ids == a.completion_ids
    t = res.timings
    assert 0 < t.plain_rounds < t.rounds, "the planner measures plain and drafting rounds"
    assert t.draft_tau > 1.2


def test_auto_behaviour_logprobs_match_the_closed_form(models, fast_reprobe):
    """T = 1, MARS, adaptive K: plain rounds emit log p, drafting rounds of every chain length
    the rule's induced log-prob, whatever the planner picks round by round."""
    from test_engine_utils import induced_logprob

    target, head = models
    rule_cfg = VerifierConfig("mars", {"theta": 0.5})
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=tuple(range(0, 64, 16)))
    spec = SpecConfig(mode="chain", num_draft_tokens=4, max_batch="auto", adaptive_k=True)
    res = Engine(target, head, num_threads=1).generate(PROMPTS * 2, sampling, spec, rule_cfg, seed=3, debug=True)
    t = res.timings
    assert 0 < t.plain_rounds < t.rounds
    rule = rule_cfg.rule()
    for rec in res.debug:
        comp = res.completions[rec.row]
        assert comp.behaviour_logprobs[rec.index] == pytest.approx(induced_logprob(rule, rec, sampling), abs=1e-4)
    assert len(res.debug) == sum(c.num_tokens for c in res.completions)


def test_the_engine_keeps_its_planner_across_calls(models):
    """One planner per speculation, verifier and sampling setting, kept by the engine: a second
    call starts from the first one's costs (no new probe rounds) with its acceptance counts
    discounted; another setting gets its own; ``forget_plans`` drops them."""
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto", adaptive_k=True)
    engine.generate(PROMPTS, sampling, spec, seed=1)
    planner = engine.planner(spec, VerifierConfig(), sampling)  # the one the call used (discounted once more)
    assert planner._round_cost and sum(planner._attempts) > 0
    attempts, costs = list(planner._attempts), dict(planner._round_cost)
    assert engine.planner(spec, VerifierConfig(), sampling) is planner
    assert planner._attempts == [a * planner.carry for a in attempts] and planner._round_cost == costs
    assert engine.planner(spec, VerifierConfig("mars", {"theta": 0.5}), sampling) is not planner
    engine.forget_plans()
    assert engine.planner(spec, VerifierConfig(), sampling) is not planner


def test_auto_lossless_t1_matches_autoregressive_distribution(models, fast_reprobe):
    """Monte Carlo: the first 3 tokens of one prompt under lossless chain + auto (switching
    between plain rounds and chain lengths) follow the same law as plain decoding: the
    per-position token frequencies agree within 5 sigma over 300 samples each."""
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto", adaptive_k=True)
    n = 300
    prompts = [PROMPTS[0]] * 20
    freqs = []
    for s in (SpecConfig(mode="off"), spec):
        counts = torch.zeros(3, target.vocab_size)
        for seed in range(n // len(prompts)):
            for c in engine.generate(prompts, sampling, s, seed=100 + seed).completions:
                for i, tok in enumerate(c.completion_ids):
                    counts[i, tok] += 1
        freqs.append(counts / n)
    # the pooled frequency, and a floor of one count: a token of probability ~1/n seen 0 times in
    # one sample and 2-3 in the other is chance, not a different law (it had failed now and then)
    pooled = (freqs[0] + freqs[1]) / 2
    sigma = ((pooled * (1 - pooled) + 1 / n) * 2 / n).sqrt()
    assert bool(((freqs[0] - freqs[1]).abs() <= 5 * sigma + 1e-9).all())


def test_auto_validation():
    assert SpecConfig(max_batch="auto").auto and not SpecConfig(mode="off", max_batch="auto").auto
    with pytest.raises(ConfigError, match="'max_batch'"):
        SpecConfig(max_batch="sometimes")
    with pytest.raises(ConfigError, match="'adaptive_k'"):
        SpecConfig(adaptive_k=True)  # without max_batch auto
    with pytest.raises(ConfigError, match="'adaptive_k'"):
        SpecConfig(mode="tree", max_batch="auto", adaptive_k=True)


def test_a_catch_up_computes_draft_logits_at_each_rows_last_pair_only(models):
    """draft_root runs the draft's lm_head at each row's last waiting pair only (a catch-up over
    a prompt or many skipped rounds had computed the draft vocabulary's logits at every pair);
    its logits and hidden equal the head's own forward over each row's pairs, from scratch."""
    from rollout.eagle3_head import causal_mask
    from rollout.engine.runner import DRAFT_POSITION_OFFSET

    target, head = models
    runner = ModelRunner(target, head)
    runner.set_first_tokens(runner.start(PROMPTS, capacity=64).argmax(-1))
    for _ in range(3):
        _plain_round(runner)  # skipped rounds: the next draft_root consumes prompt + 3 pairs
    runner._merge_waiting()
    tokens, feats, counts = runner._wait_tokens.clone(), runner._wait_feats.clone(), runner._wait_host
    calls = []
    real_forward = type(head).forward

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("compute_logits", True))
        return real_forward(self, *args, **kwargs)

    type(head).forward = spy
    try:
        root = runner.draft_root()
    finally:
        type(head).forward = real_forward
    assert calls == [False], calls  # the catch-up forward skipped the lm_head
    for i, n in enumerate(counts):
        pos = torch.arange(n)[None] + DRAFT_POSITION_OFFSET
        ref = head(tokens[i:i + 1, :n], feats[i:i + 1, :n], pos, causal_mask(1, n))
        torch.testing.assert_close(root.logits[i], ref.logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(root.hidden[i], ref.hidden[0, -1], atol=1e-5, rtol=1e-5)


def test_the_engine_traces_its_planners_rounds_on_request(models):
    """``Engine.trace_plans``: a record per planner round of each call (a round per target forward
    after the prefill's), with its seconds, emitted tokens and reason; ``plan_trace`` reads them
    without starting a call; ``trace_plans(False)`` stops and drops them. Outputs are the same."""
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0, max_new_tokens=16)
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    ref = engine.generate(PROMPTS, sampling, spec)
    assert engine.plan_trace(spec, VerifierConfig(), sampling) is None  # not tracing
    engine.forget_plans()
    engine.trace_plans()
    res = engine.generate(PROMPTS, sampling, spec)
    assert [c.completion_ids for c in res.completions] == [c.completion_ids for c in ref.completions]
    trace = engine.plan_trace(spec, VerifierConfig(), sampling)
    t = res.timings
    assert len(trace) == t.rounds == t.target_forwards - 1 and sum(r["k"] == 0 for r in trace) == t.plain_rounds
    assert all(r["call"] == 0 and r["round_s"] > 0 and r["batch"] >= 1 and len(r["emitted"]) == r["batch"]
               for r in trace)
    assert engine.plan_trace(spec, VerifierConfig(), sampling) is trace  # no call started
    engine.generate(PROMPTS, sampling, spec)
    assert len(trace) > t.rounds and trace[-1]["call"] == 1
    engine.trace_plans(False)
    assert engine.plan_trace(spec, VerifierConfig(), sampling) is None


def test_a_tree_round_off_the_blocks_prefix_feeds_the_draft_its_path(models):
    """A tree round commits the root and the drafts on its accepted path (block offsets 0, 2, 3
    here, not the block's prefix 0, 1, 2): the draft then consumes each committed token's own
    target features, and stands exactly where plain rounds over the same tokens leave it."""
    target, head = models
    outs = []
    for tree in (True, False):
        runner = ModelRunner(target, head)
        first = runner.start(PROMPTS, capacity=64).argmax(-1)
        runner.set_first_tokens(first)
        b = runner.batch
        a, x, y, final = (torch.full((b,), t) for t in (7, 11, 13, 17))  # x, y: the accepted path
        if tree:  # block [root, a, x, y]: a and x children of the root, y of x
            tokens = torch.stack([runner.pending, a, x, y], 1)
            depths = torch.tensor([[0, 1, 1, 2]])
            mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[None]
            _, feats = runner.verify_forward(tokens, depths, mask)
            path = torch.tensor([[0, 2, 3]]).expand(b, 3)
            runner.commit(torch.full((b,), 3), [3] * b, torch.stack([x, y, final], 1), feats, path)
        else:
            for forced in (x, y, final):
                _, feats = runner.verify_forward(runner.pending[:, None], torch.zeros(1, 1, dtype=torch.long), None)
                runner.commit(torch.ones(b, dtype=torch.long), [1] * b, forced[:, None], feats, None)
        root = runner.draft_root()
        outs.append((root.logits, root.hidden, runner.draft_kv.lengths.tolist()))
    (l0, h0, n0), (l1, h1, n1) = outs
    assert n0 == n1 == [len(p) + 3 for p in PROMPTS]
    torch.testing.assert_close(h0, h1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l0, l1, atol=1e-5, rtol=1e-5)
