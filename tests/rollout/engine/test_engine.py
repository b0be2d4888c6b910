"""Engine tests at T = 0 and the engine's contract: greedy equality, stops, limits, errors."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_engine_utils import (PROMPTS, assert_speculative_greedy_equals_plain, copy_head,  # noqa: F401
                               single_thread, tiny_target, trained_head)

from rollout.config import ConfigError, from_dict
from rollout.engine.engine import Engine
from rollout.params import SamplingParams, SpecConfig, VerifierConfig

SPECS = {
    "chain-sampled": SpecConfig(mode="chain", num_draft_tokens=4),
    "chain-greedy": SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
    "tree": SpecConfig(mode="tree", depth=4, top_k=3, total_tokens=10),
    "tree-wide": SpecConfig(mode="tree", depth=2, top_k=5, total_tokens=12),
    "tree-sampled": SpecConfig(mode="tree", depth=4, top_k=3, total_tokens=10, tree_candidates="sampled"),
}


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target()
    return target, trained_head(target, draft_vocab=48)


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_autoregressive_greedy_matches_hf_generate(models):
    target, head = models
    res = Engine(target, head, num_threads=1).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=24))
    for prompt, comp in zip(PROMPTS, res.completions):
        assert comp.prompt_ids == prompt
        assert comp.completion_ids == hf_greedy(target, prompt, 24)
        assert comp.behaviour_logprobs == [0.0] * 24 and comp.finish_reason == "length"
    assert res.timings.tau == 1.0


@pytest.mark.parametrize("name", list(SPECS))
def test_speculative_greedy_equals_autoregressive(models, name):
    target, head = models
    res = assert_speculative_greedy_equals_plain(Engine(target, head, num_threads=1), SPECS[name])
    assert res.tau > 1.3


def test_mars_greedy_is_deterministic(models):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0, max_new_tokens=30)
    rule = VerifierConfig("mars", {"theta": 0.5})
    a = engine.generate(PROMPTS, sampling, SPECS["tree"], rule, seed=1)
    b = engine.generate(PROMPTS, sampling, SPECS["tree"], rule, seed=2)
    assert [c.completion_ids for c in a.completions] == [c.completion_ids for c in b.completions]


def test_stop_tokens_end_completions(models):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=30))
    stop = greedy.completions[2].completion_ids[5]
    sampling = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(stop,))
    for spec in (SpecConfig(mode="off"), SPECS["chain-sampled"], SPECS["tree"], SPECS["tree-sampled"]):
        res = engine.generate(PROMPTS, sampling, spec)
        for full, comp in zip(greedy.completions, res.completions):
            ids = full.completion_ids
            cut = ids.index(stop) + 1 if stop in ids else len(ids)
            assert comp.completion_ids == ids[:cut]
            assert comp.finish_reason == ("stop" if stop in ids else "length")
            assert len(comp.kinds) == len(comp.behaviour_logprobs) == len(comp.relaxed) == cut


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_is_exact(models, max_new):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    res = engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new), SPECS["chain-sampled"], seed=3)
    assert [c.num_tokens for c in res.completions] == [max_new] * len(PROMPTS)
    assert res.timings.tokens == max_new * len(PROMPTS)


def test_empty_prompt_list(single_thread):
    target = tiny_target()
    res = Engine(target, copy_head(target), num_threads=1).generate([], SamplingParams(), SPECS["tree"])
    assert res.completions == [] and res.timings.tokens == 0


def test_prompt_errors_and_context_cap(single_thread):
    target = tiny_target(context=64)
    engine = Engine(target, copy_head(target), num_threads=1)
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens but the target's context is 64"):
        engine.generate([[1, 2], [3] * 64], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 999]], SamplingParams())
    res = engine.generate([[5] * 60, [1, 2]], SamplingParams(max_new_tokens=10), SPECS["chain-sampled"])
    assert [c.num_tokens for c in res.completions] == [4, 10]  # the first row hits the context


def test_prompts_that_are_not_token_id_lists_are_named(single_thread):
    engine = Engine(tiny_target(), num_threads=1)
    for prompts, words in (([[1.0, 2.5]], "prompt 0 position 0 is float 1.0: token ids must be integers"),
                           ([[1, 2], [3, True]], "prompt 1 position 1 is bool True"),
                           ([[1, 2], "hello"], "prompt 1 is a str ('hello'), not a list of token ids"),
                           ([1, 2, 3], "prompt 0 is a int (1)"),
                           ("hello", "a list of token-id lists, got str")):
        with pytest.raises(TypeError, match=re.escape(words)):
            engine.generate(prompts, SamplingParams(max_new_tokens=2))
    import numpy as np

    ids = np.array([1, 2, 3])  # numpy integers (as a tokenizer's arrays give) are token ids
    assert engine.generate([list(ids)], SamplingParams(max_new_tokens=2)).completions[0].num_tokens == 2


def test_a_nan_in_a_round_names_the_prompt_of_its_batch_row(single_thread, monkeypatch):
    """The verifiers name a row of the round's batch; once rows finish, that is not the prompt's
    index, so the engine adds which prompt each batch row is."""
    from rollout.engine.runner import ModelRunner

    target = tiny_target()
    engine = Engine(target, copy_head(target), num_threads=1)
    forward = ModelRunner.verify_forward

    def poisoned(self, *args, **kwargs):
        logits, feats = forward(self, *args, **kwargs)
        if len(self._rows) == 2:  # prompt 0 has finished: batch row 1 is prompt 2
            logits = logits.clone()
            logits[1, 0, 3] = float("nan")
        return logits, feats

    monkeypatch.setattr(ModelRunner, "verify_forward", poisoned)
    # prompt 0 fills the context but for 2 tokens: it ends in the first round
    prompts = [[5] * 254, [3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match=r"row 1, position 0 contains NaN") as err:
        engine.generate(prompts, SamplingParams(max_new_tokens=12), SPECS["chain-sampled"])
    live = re.search(r"round 2 of this call: batch row r is prompt \[(\d+), (\d+)\]\[r\]", str(err.value))
    assert live is not None and sorted(map(int, live.groups())) == [1, 2], str(err.value)


def test_a_head_for_another_target_is_refused_naming_the_field(single_thread):
    from rollout.eagle3_io import HeadMismatchError

    target, other = tiny_target(), tiny_target(vocab=80)
    with pytest.raises(HeadMismatchError, match="vocabulary mismatch: head vocab_size 80, target vocab_size 64"):
        Engine(target, copy_head(other), num_threads=1)
    head = copy_head(target)
    head.cfg = dataclasses.replace(head.cfg, target_hidden_size=32)
    words = "features of a target with hidden size 32 (fc in = 3 x 32), this target has hidden size 64"
    with pytest.raises(HeadMismatchError, match=re.escape(words)):
        Engine(target, head, num_threads=1)
    head = copy_head(target)
    head.cfg = dataclasses.replace(head.cfg, aux_layer_ids=(0, 1, 2))
    with pytest.raises(HeadMismatchError, match=r"features of layers \(0, 1, 2\), the target captures"):
        Engine(target, head, num_threads=1)


def test_speculation_needs_a_head(single_thread):
    engine = Engine(tiny_target(), num_threads=1)
    with pytest.raises(ValueError, match="needs a draft head"):
        engine.generate([[1, 2]], SamplingParams(), SPECS["tree"])
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=3)).completions[0].num_tokens == 3


@pytest.mark.parametrize("name", ["off", "chain-sampled", "chain-greedy", "tree", "tree-sampled"])
def test_seeded_determinism(models, name):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    spec = SpecConfig(mode="off") if name == "off" else SPECS[name]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20)
    a, b, c = (engine.generate(PROMPTS, sampling, spec, seed=s) for s in (7, 7, 8))
    assert [x.completion_ids for x in a.completions] == [x.completion_ids for x in b.completions]
    assert [x.behaviour_logprobs for x in a.completions] == [x.behaviour_logprobs for x in b.completions]
    assert [x.completion_ids for x in a.completions] != [x.completion_ids for x in c.completions]


def test_rollout_batch_pads_completions(models):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    res = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), SPECS["tree"], seed=0)
    batch = res.to_batch(policy_version=3)
    assert batch.completion_ids.shape == (len(PROMPTS), 6)
    assert batch.prompt_mask.sum(1).tolist() == [len(p) for p in PROMPTS]
    assert batch.completion_ids[2].tolist() == res.completions[2].completion_ids
    assert torch.allclose(batch.behaviour_logprobs[1], torch.tensor(res.completions[1].behaviour_logprobs))
    assert batch.policy_version == 3 and batch.tau == res.tau


def test_params_validation_names_fields():
    with pytest.raises(ConfigError, match="'mode'.*allowed: off, chain, tree"):
        SpecConfig(mode="beam")
    with pytest.raises(ConfigError, match="'draft_sampling'"):
        SpecConfig(draft_sampling="nucleus")
    with pytest.raises(ConfigError, match="'total_tokens'"):
        SpecConfig(mode="tree", depth=2, top_k=2, total_tokens=7)
    with pytest.raises(ConfigError, match="'temperature'"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="'top_p'"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="'stop_token_ids'"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(ConfigError, match="'name'.*allowed:.*lossless"):
        VerifierConfig("nope")
    with pytest.raises(ConfigError, match=r"'params\.theta'.*must be in \[0, 1\], got 7"):
        VerifierConfig("mars", {"theta": 7})
    with pytest.raises(ConfigError, match="'params': must be a mapping"):
        VerifierConfig("mars", [0.5])
    with pytest.raises(ConfigError, match="'tree_candidates'.*allowed: top_k, sampled"):
        SpecConfig(mode="tree", tree_candidates="gumbel")
    with pytest.raises(ConfigError, match="'total_tokens'.*14 nodes"):
        SpecConfig(mode="tree", depth=3, top_k=2, total_tokens=15, tree_candidates="sampled")
    spec = from_dict(SpecConfig, {"mode": "tree", "depth": 3})
    assert spec.depth == 3 and spec.block_size == spec.total_tokens + 1
    assert from_dict(SamplingParams, {"stop_token_ids": [2]}).stop_token_ids == (2,)


def test_setup_time_covers_the_prefill_and_not_the_rounds(models, monkeypatch):
    """Timings.setup_s: everything before the first round (weight packing, the prefill)."""
    import time

    from rollout.engine.runner import ModelRunner

    target, head = models
    engine = Engine(target, head, num_threads=1)
    start, verify = ModelRunner.start, ModelRunner.verify_forward
    monkeypatch.setattr(ModelRunner, "start", lambda self, *a: time.sleep(0.2) or start(self, *a))
    monkeypatch.setattr(ModelRunner, "verify_forward", lambda self, *a: time.sleep(0.02) or verify(self, *a))
    t = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=10), SpecConfig(mode="off")).timings
    assert t.rounds == 9  # the first token comes from the prefill
    assert 0.2 <= t.setup_s < 0.2 + 9 * 0.02 <= t.total_s  # (the rounds are not in it)
    assert t.total_s - t.setup_s >= 9 * 0.02
