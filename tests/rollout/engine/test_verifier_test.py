"""``VerifierConfig.test``: ``rule`` (the rule's own acceptance test) or ``law`` (rejection
towards the law that test induces; ``verifiers.verify_chain``). Bad values name the field and
the allowed ones; ``law`` over drafts without q (greedy chains, top-k trees) is refused by the
engine, the training config, the TRL settings and the vllm backend's check, naming
``verifier.test``; the scripts' verifier specs carry it (``mars:theta=0.9,test=law``); the
engine runs it (the behaviour log-prob and law tests are in test_engine_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

from rollout.config import ConfigError, from_dict
from rollout.engine.engine import Engine
from rollout.params import SamplingParams, SpecConfig, VerifierConfig, check_test
from trainers.drift.study import parse_verifier, verifier_label
from trainers.grpo.config import RolloutConfig
from trainers.trl.rollouts import RolloutSettings

LAW = VerifierConfig("mars", {"theta": 0.9}, "law")
GREEDY = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy")
TOP_K_TREE = SpecConfig(mode="tree")
SAMPLED = SpecConfig(mode="chain", num_draft_tokens=3)


def test_bad_values_name_the_field_and_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"'test'.*'best'.*allowed: rule, law"):
        VerifierConfig("mars", test="best")
    with pytest.raises(ConfigError, match=r"'verifier.test'"):
        from_dict(RolloutConfig, {"verifier": {"name": "mars", "test": "best"}})
    assert from_dict(VerifierConfig, {"name": "mars", "test": "law"}).test == "law"


@pytest.mark.parametrize("spec, words", [(GREEDY, "greedy chain drafts"), (TOP_K_TREE, "top-k tree candidates")])
def test_law_over_deterministic_drafts_is_refused_everywhere(spec, words):
    for build in (lambda: check_test(spec, LAW), lambda: RolloutConfig(spec=spec, verifier=LAW),
                  lambda: RolloutSettings(spec=spec, verifier=LAW)):
        with pytest.raises(ConfigError, match=rf"'verifier.test': 'law' needs drafts sampled from q; {words}"):
            build()
    for spec_ok in (SAMPLED, SpecConfig(mode="tree", tree_candidates="sampled"), SpecConfig(mode="off")):
        check_test(spec_ok, LAW)
        assert RolloutConfig(spec=spec_ok, verifier=LAW).verifier.test == "law"
    check_test(spec, LAW, temperature=0.0)  # at T = 0 every test is the rule's greedy test
    assert RolloutConfig(spec=spec, verifier=LAW, sampling=SamplingParams(temperature=0.0)).verifier.test == "law"


def test_the_engine_refuses_it_and_runs_it_on_sampled_chains(single_thread):
    target = tiny_target(vocab=64, seed=5)
    engine = Engine(target, trained_head(target, draft_vocab=48, seed=6), num_threads=1)
    sampling = SamplingParams(max_new_tokens=8)
    with pytest.raises(ConfigError, match="'verifier.test'"):
        engine.generate(PROMPTS, sampling, GREEDY, LAW)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    same = [engine.generate(PROMPTS, greedy, GREEDY, v).completions for v in (LAW, VerifierConfig("mars", {"theta": 0.9}))]
    assert [c.completion_ids for c in same[0]] == [c.completion_ids for c in same[1]]
    res = engine.generate(PROMPTS, sampling, SAMPLED, LAW, seed=1)
    assert all(c.num_tokens == 8 for c in res.completions)
    assert torch.isfinite(torch.tensor([lp for c in res.completions for lp in c.behaviour_logprobs])).all()


def test_verifier_specs_carry_it():
    v = parse_verifier("mars:theta=0.8,test=law")
    assert (v.name, v.params, v.test) == ("mars", {"theta": 0.8}, "law")
    assert verifier_label(v) == "mars:theta=0.8,test=law" and parse_verifier(verifier_label(v)) == v
    assert verifier_label(parse_verifier("mars")) == "mars"
    assert parse_verifier({"name": "overshoot", "params": {"lenience": 0.5}, "test": "law"}).test == "law"
    with pytest.raises(ConfigError, match="'test'"):
        parse_verifier("mars:test=fast")


BLOCK = VerifierConfig("lossless", test="block")


def test_block_is_for_the_lossless_rule_on_sampled_drafts():
    """``test: block`` (``verifiers.block``, ``verifiers.block_tree``): a lossy rule is refused
    naming the field and what it may use; greedy chains and top-k trees are refused everywhere the
    test is checked; sampled chains and trees, plain decoding and T = 0 take it; the scripts' specs
    carry it."""
    with pytest.raises(ConfigError, match=r"'test'.*exact for the lossless rule only, not 'mars'.*allowed: rule, law"):
        VerifierConfig("mars", {"theta": 0.9}, "block")
    with pytest.raises(ConfigError, match=r"'verifier.test'.*lossless rule only"):
        from_dict(RolloutConfig, {"verifier": {"name": "overshoot", "test": "block"}})
    for spec, words in [(GREEDY, "greedy chain drafts"), (TOP_K_TREE, "top-k tree candidates")]:
        for build in (lambda: check_test(spec, BLOCK), lambda: RolloutConfig(spec=spec, verifier=BLOCK),
                      lambda: RolloutSettings(spec=spec, verifier=BLOCK)):
            with pytest.raises(ConfigError, match=rf"'verifier.test': 'block' verifies drafts sampled from q; "
                                                  rf"{words} .* are deterministic.*allowed: rule"):
                build()
        check_test(spec, BLOCK, temperature=0.0)
    for spec_ok in (SAMPLED, SpecConfig(mode="off"), SpecConfig(mode="tree", tree_candidates="sampled")):
        assert RolloutConfig(spec=spec_ok, verifier=BLOCK).verifier.test == "block"
    assert parse_verifier("lossless:test=block") == BLOCK
