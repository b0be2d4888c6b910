"""Engine tests at T > 0: lossless speculation samples the target's distribution, every
emitted token's behaviour log-prob is the closed-form induced distribution evaluated at
the engine's own logits, and target log-probs match a cache-free recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine_utils import (PROMPTS, assert_first_tokens_follow_the_target, chi2_pvalue,  # noqa: F401
                               exact_three_token_law, induced_logprob, single_thread, tiny_target, trained_head)

from rollout.engine.engine import Engine
from rollout.kernels.quantize import quantize_int8_
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import TokenKind, target_logprobs

SPECS = {
    "chain-sampled": SpecConfig(mode="chain", num_draft_tokens=3),
    "chain-greedy": SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8),
}
SAMPLED_TREE = SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, tree_candidates="sampled")
LOSSLESS_SPECS = {**SPECS, "tree-sampled": SAMPLED_TREE}
LOSSY = {
    "mars": {"theta": 0.5},
    "overshoot": {"lenience": 0.5},
    "typical": {},
    "min_p": {"p_base": 0.2},
}


@pytest.fixture(scope="module")
def small(single_thread):
    """A 12-token vocabulary (9 in the draft) for exact distributions."""
    target = tiny_target(vocab=12, seed=3, logit_scale=4.0)
    return target, trained_head(target, draft_vocab=9, seed=4)


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target(vocab=64, seed=5)
    return target, trained_head(target, draft_vocab=48, seed=6)


def test_chi2_pvalue_is_scipys():
    """The shared ``chi2_pvalue`` (torch alone) gives scipy's ``chisquare`` p-value, pooled cells too."""
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    for cells, n, skew in [(144, 3000, 4.0), (12, 500, 1.0), (40, 60, 3.0)]:
        probs = torch.softmax(torch.randn(cells, generator=g, dtype=torch.float64) * skew, 0)
        counts = torch.bincount(torch.multinomial(probs, n, replacement=True, generator=g), minlength=cells)
        expected = probs * n
        small = expected < 5  # scipy's test over the same cells: those below 5 expected pooled into one
        obs, exp = counts[~small].double(), expected[~small]
        if small.any():
            obs = torch.cat([obs, counts[small].sum()[None].double()])
            exp = torch.cat([exp, expected[small].sum()[None]])
        want = stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
        assert chi2_pvalue(counts, probs) == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", list(LOSSLESS_SPECS))
def test_lossless_samples_the_target_distribution(small, name):
    target, head = small
    engine = Engine(target, head, num_threads=1)
    prompts = [[1, 5, 2, 7], [3]]
    rows = 1500
    res = engine.generate([p for p in prompts for _ in range(rows)], SamplingParams(max_new_tokens=3),
                          LOSSLESS_SPECS[name], seed=11)
    v = target.vocab_size
    kinds = torch.tensor([c.kinds[1:] for c in res.completions])
    assert (kinds == TokenKind.ACCEPTED).float().mean() > 0.1, "drafts must be accepted for the test to mean much"
    for i, prompt in enumerate(prompts):
        law = exact_three_token_law(target, prompt)
        ys = torch.tensor([c.completion_ids for c in res.completions[i * rows:(i + 1) * rows]])
        pair12 = torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v)
        pair23 = torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v)
        assert chi2_pvalue(pair12, law.sum(2)) > 1e-3
        assert chi2_pvalue(pair23, law.sum(0)) > 1e-3
    for c in res.completions:
        assert c.behaviour_logprobs == pytest.approx(c.target_logprobs, abs=1e-5)


@pytest.mark.parametrize("name", ["chain-sampled", "tree"])
def test_an_int8_head_stays_lossless(small, name):
    """The head rounded to int8 weights (``drafter_weights: int8``, rollout.kernels.quantize) drafts from
    its own law, against which its drafts are verified: the tokens still follow the target's."""
    target, head = small
    head = copy.deepcopy(head)
    quantize_int8_(head)
    prompt, rows = [1, 5, 2, 7], 2500
    res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=3),
                                                      SPECS[name], seed=23)
    assert_first_tokens_follow_the_target(target, prompt, res.completions, 0.1 * 2 * rows)


@pytest.mark.parametrize("spec", [SPECS["chain-sampled"], SpecConfig(mode="chain", num_draft_tokens=3,
                                                                    max_batch="auto", adaptive_k=True), SAMPLED_TREE],
                         ids=["chain", "auto", "sampled-tree"])
def test_block_verification_samples_the_target_distribution(small, spec):
    """``verifier.test: block`` (``verifiers.block``; on a sampled tree ``verifiers.block_tree``):
    the first three tokens follow the target's law, the second and third from inside the block;
    every behaviour log-prob is the target's."""
    target, head = small
    prompt, rows = [1, 5, 2, 7], 3000
    res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=4), spec,
                                                      VerifierConfig("lossless", test="block"), seed=17)
    assert_first_tokens_follow_the_target(target, prompt, res.completions, 0.1 * 3 * rows)


def test_a_sampled_tree_walked_level_by_level_samples_the_target_distribution(small):
    """Without the C++ verifier a sampled tree is walked node level by node level from Python
    (``rollout.engine.tree.walk``, other random numbers than the fused walk): the same law."""
    from verifiers import native

    target, head = small
    prompt, rows, v = [1, 5, 2, 7], 1500, target.vocab_size
    with native.forced(False):
        res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=3),
                                                          SAMPLED_TREE, seed=19)
    ys = torch.tensor([c.completion_ids for c in res.completions])
    law = exact_three_token_law(target, prompt)
    assert chi2_pvalue(torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v), law.sum(2)) > 1e-3
    assert chi2_pvalue(torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v), law.sum(0)) > 1e-3
    assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) > 0.1 * 2 * rows


@pytest.mark.parametrize("other", ["tree", "chain-law"])
@pytest.mark.parametrize("rule_name", ["mars", "overshoot"])
def test_a_lossy_rules_law_test_emits_its_chains_law(small, rule_name, other):
    """At the first drafted position (the second token) a sampled tree verified towards a lossy
    rule's chain law, or a sampled chain with ``test: law``, and that rule's sampled chain with
    its own test draw from the same law (two-sample chi-square over (y1, y2)), and it is not the
    target's (the test has the power to see the rule)."""
    from scipy.stats import chi2_contingency

    target, head = small
    prompt, rows, v = [1, 5, 2, 7], 3000, target.vocab_size
    params = {"theta": 0.3} if rule_name == "mars" else {"lenience": 0.3}
    runs = {"chain": (SPECS["chain-sampled"], "rule"),
            other: (SAMPLED_TREE, "rule") if other == "tree" else (SPECS["chain-sampled"], "law")}
    pairs, accepted = {}, {}
    for name, (spec, test) in runs.items():
        res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=2), spec,
                                                          VerifierConfig(rule_name, params, test), seed=23)
        ys = torch.tensor([c.completion_ids for c in res.completions])
        pairs[name] = torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v)
        accepted[name] = sum(c.kinds[1] == TokenKind.ACCEPTED for c in res.completions)
    assert accepted[other] > 0.3 * rows
    if rule_name == "mars":  # the law's coupling accepts more than MARS's own test
        assert accepted[other] > 1.05 * accepted["chain"]
    table = torch.stack([pairs[other], pairs["chain"]])
    table = table[:, table.sum(0) > 0].numpy()
    assert chi2_contingency(table).pvalue > 1e-3
    law = exact_three_token_law(target, prompt).sum(2)
    assert chi2_pvalue(pairs[other], law) < 1e-6, "the rule's law should differ from the target's here"


def test_a_scaled_draft_stays_lossless(small):
    """A head with draft_logit_scale != 1 drafts from softmax(scale * logits / T) and the verifier
    sees that same q: lossless rollouts still follow the target's law exactly."""
    import copy
    import dataclasses

    target, head = small
    head = copy.deepcopy(head)
    head.cfg = dataclasses.replace(head.cfg, logit_scale=2.5)
    prompt, rows, v = [1, 5, 2, 7], 1500, target.vocab_size
    res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=3),
                                                      SPECS["chain-sampled"], seed=13)
    ys = torch.tensor([c.completion_ids for c in res.completions])
    law = exact_three_token_law(target, prompt)
    assert chi2_pvalue(torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v), law.sum(2)) > 1e-3
    assert chi2_pvalue(torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v), law.sum(0)) > 1e-3
    assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) > 0.1 * 2 * rows


def test_the_distribution_test_detects_a_lossy_rule(small):
    """Power check: MARS with a low theta visibly changes the law of the first tokens."""
    target, head = small
    engine = Engine(target, head, num_threads=1)
    prompt = [1, 5, 2, 7]
    res = engine.generate([prompt] * 1500, SamplingParams(max_new_tokens=3), SPECS["chain-sampled"],
                          VerifierConfig("mars", {"theta": 0.05}), seed=11)
    v = target.vocab_size
    ys = torch.tensor([c.completion_ids for c in res.completions])
    assert chi2_pvalue(torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v),
                       exact_three_token_law(target, prompt).sum(0)) < 1e-6


@pytest.mark.parametrize("name", [*SPECS, "tree-sampled", "tree-sampled-python", "chain-law", "chain-law-python",
                                  "chain-law-auto"])
@pytest.mark.parametrize("rule_name", ["lossless", *LOSSY])
def test_behaviour_logprob_is_the_induced_distribution(models, name, rule_name):
    """(tree-sampled: the fused C++ walk; -python: node level by node level; chain-law: sampled
    chains with ``verifier.test: law``, -auto: with ``max_batch: auto`` and adaptive K.) A sampled
    tree's records carry each node's q: a lossy rule's law there is its chain law; so is a
    law-tested chain's."""
    from verifiers import native

    target, head = models
    engine = Engine(target, head, num_threads=1)
    verifier = VerifierConfig(rule_name, LOSSY.get(rule_name, {}), "law" if "law" in name else "rule")
    # 32 tokens: MARS (theta 0.5) relaxes 2-10 tokens per call on this model over seeds 0-7
    sampling = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=32)
    spec = SPECS["chain-sampled"] if "law" in name else SPECS.get(name, SAMPLED_TREE)
    if name.endswith("auto"):
        spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto", adaptive_k=True)
    with native.forced(not name.endswith("python")):
        res = engine.generate(PROMPTS, sampling, spec, verifier, seed=2, debug=True)
    assert len(res.debug) == res.timings.tokens, "one debug record per emitted token"
    rule = verifier.rule()
    for rec in res.debug:
        comp = res.completions[rec.row]
        assert comp.completion_ids[rec.index] == rec.token
        assert comp.behaviour_logprobs[rec.index] == pytest.approx(induced_logprob(rule, rec, sampling), abs=1e-4)
        p = target_logprobs(rec.target_logits, sampling.temperature, sampling.top_k)
        assert comp.target_logprobs[rec.index] == pytest.approx(float(p[rec.token]), abs=1e-4)
    if spec.auto:  # the planner drafted in some rounds (their tokens carry q) and decoded plainly in others
        assert res.timings.plain_rounds < res.timings.rounds
        assert sum(rec.draft_logits is not None for rec in res.debug) >= 4
    if spec.sampled_tree:
        assert sum(rec.draft_logits is not None for rec in res.debug) > 0.3 * len(res.debug)
        assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) > 0.1 * len(res.debug)
    relaxed = sum(sum(c.relaxed) for c in res.completions)
    if rule_name in ("mars", "overshoot"):
        assert relaxed > 0, "the lossy branch should fire on this model"
    if rule_name == "lossless":
        assert relaxed == 0


@pytest.mark.parametrize("name", ["off", *LOSSLESS_SPECS])
def test_target_logprobs_match_a_cache_free_forward(models, name):
    """Every emitted token's log p equals a plain forward over prompt + completion: the
    caches, masks and positions are right after many rounds of mixed acceptance."""
    target, head = models
    engine = Engine(target, head, num_threads=1)
    spec = SpecConfig(mode="off") if name == "off" else LOSSLESS_SPECS[name]
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, stop_token_ids=(7,))
    res = engine.generate(PROMPTS * 2, sampling, spec, seed=5)
    assert len({c.num_tokens for c in res.completions}) > 1, "rows should finish at different times"
    for comp in res.completions:
        seq = torch.tensor([comp.prompt_ids + comp.completion_ids])
        with torch.no_grad():
            logits = target(seq, use_cache=False).logits[0, len(comp.prompt_ids) - 1:-1]  # [C, V]
        lp = target_logprobs(logits, 1.0, None, 0.95)
        ref = lp.gather(1, torch.tensor(comp.completion_ids)[:, None])[:, 0]
        assert comp.target_logprobs == pytest.approx(ref.tolist(), abs=2e-4)
        assert comp.behaviour_logprobs == pytest.approx(ref.tolist(), abs=2e-4)


def test_a_sampled_tree_replanned_every_round_stays_lossless(small, monkeypatch):
    """The shape of a sampled tree re-planned after every round from the rates measured so far
    (a tiny prior: it does change) keeps the target's law: a round's shape depends only on the
    rounds before it."""
    from rollout.engine import sampled_tree

    monkeypatch.setattr(sampled_tree, "REPLAN_ROUNDS", 1)
    monkeypatch.setattr(sampled_tree, "PRIOR_TRIALS", 1.0)
    shapes = []
    replan = sampled_tree.sampled_shape
    monkeypatch.setattr(sampled_tree, "sampled_shape", lambda *a, **kw: shapes.append(replan(*a, **kw)) or shapes[-1])
    target, head = small
    prompt, rows, v = [1, 5, 2, 7], 1500, target.vocab_size
    spec = SpecConfig(mode="tree", depth=2, top_k=3, total_tokens=4, tree_candidates="sampled")
    res = Engine(target, head, num_threads=1).generate([prompt] * rows, SamplingParams(max_new_tokens=4), spec, seed=17)
    assert len({s.parents for s in shapes}) > 1, "the shape should change during the call"
    ys = torch.tensor([c.completion_ids for c in res.completions])
    law = exact_three_token_law(target, prompt)
    assert chi2_pvalue(torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v), law.sum(2)) > 1e-3
    assert chi2_pvalue(torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v), law.sum(0)) > 1e-3
