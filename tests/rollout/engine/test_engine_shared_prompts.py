"""Identical prompts (GRPO's samples per prompt) are prefilled once: the engine's outputs are
the same, bit for bit, as with every row prefilled on its own, where the native linear kernel
runs (its results do not depend on the batch's rows); on torch's GEMM (a CPU without AVX-512) the
same tokens, and log-probs equal up to float32 rounding."""

from __future__ import annotations

import pytest
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.kernels import native_linear
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig

GROUPED = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[1]]


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target()
    return target, trained_head(target, draft_vocab=48)


@pytest.fixture()
def prefilled(monkeypatch):
    """The rows each runner's prefill ran."""
    seen: list[int] = []
    start = ModelRunner.start

    def spy(self, prompts, capacity):
        out = start(self, prompts, capacity)
        seen.append(self.prefilled_rows)
        return out

    monkeypatch.setattr(ModelRunner, "start", spy)
    return seen


@pytest.mark.parametrize("spec", [SpecConfig(mode="off"), SpecConfig(mode="chain", num_draft_tokens=3),
                                  SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8)],
                         ids=["plain", "chain", "tree"])
def test_shared_prefill_changes_no_output(models, spec, prefilled):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    rule = VerifierConfig("mars", {"theta": 0.5})
    shared = engine.generate(GROUPED, sampling, spec, rule, seed=5)
    unshared = Engine(target, head, num_threads=1, options=EngineOptions(share_prompts=False))
    alone = unshared.generate(GROUPED, sampling, spec, rule, seed=5)
    assert prefilled == [3, len(GROUPED)]  # 3 distinct prompts, then every row
    for a, b in zip(alone.completions, shared.completions):
        assert b.completion_ids == a.completion_ids
        if native_linear.available():
            assert b.behaviour_logprobs == a.behaviour_logprobs
            assert b.target_logprobs == a.target_logprobs
        else:
            assert b.behaviour_logprobs == pytest.approx(a.behaviour_logprobs, rel=1e-6, abs=1e-6)
            assert b.target_logprobs == pytest.approx(a.target_logprobs, rel=1e-6, abs=1e-6)


def test_distinct_prompts_and_capture_prefill_every_row(models, prefilled):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine.generate(PROMPTS, sampling)
    res = engine.generate(GROUPED, sampling, capture=True)  # every row keeps its own positions
    assert prefilled == [len(PROMPTS), len(GROUPED)]
    assert [c.features.shape[0] for c in res.captures] == [len(p) + comp.num_tokens - 1 for p, comp in zip(GROUPED, res.completions)]
