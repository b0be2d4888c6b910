"""The engine on the embedded SmolLM2-135M-Instruct with the shipped EAGLE-3 head (slow)."""

from __future__ import annotations

import pytest
import torch

from rollout.eagle3 import default_head_path, load_eagle3
from rollout.engine.engine import Engine
from rollout.models import load_embedded_target
from rollout.params import SamplingParams, SpecConfig, VerifierConfig

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have? End your reply with 'Answer: <number>'.",
    "Write one sentence about the sea.",
    "What is 12 + 7?",
]


@pytest.fixture(scope="module")
def embedded():
    if not (default_head_path() / "config.json").is_file():
        pytest.skip("the shipped head (rollout/heads/smollm2-135m-eagle3) is not there yet")
    target, tok = load_embedded_target()
    head = load_eagle3(default_head_path(), target)
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return Engine(target, head), target, prompts, tok.eos_token_id


def first_difference_is_a_near_tie(target, prompt, a: list[int], b: list[int]) -> bool:
    """Greedy outputs may part where the top-2 target logits are (numerically) tied."""
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + a[:i]]), use_cache=False).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1]) < 1e-3


def test_greedy_speculation_equals_autoregressive_on_smollm2(embedded):
    engine, target, prompts, eos = embedded
    sampling = SamplingParams(temperature=0, max_new_tokens=48, stop_token_ids=(eos,))
    ref = engine.generate(prompts, sampling, SpecConfig(mode="off"))
    for spec in (SpecConfig(mode="chain", num_draft_tokens=5), SpecConfig(mode="tree", depth=5, top_k=4,
                                                                           total_tokens=16)):
        res = engine.generate(prompts, sampling, spec)
        assert res.tau > 1.5, f"{spec.mode}: tau {res.tau:.2f} at T = 0"
        for p, a, b in zip(prompts, ref.completions, res.completions):
            if a.completion_ids != b.completion_ids:
                assert first_difference_is_a_near_tie(target, p, a.completion_ids, b.completion_ids)


def test_sampled_speculation_accepts_and_reports_exact_logprobs(embedded):
    engine, _, prompts, eos = embedded
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48, stop_token_ids=(eos,))
    lossless = engine.generate(prompts * 2, sampling, SpecConfig(mode="chain", num_draft_tokens=5), seed=1)
    assert lossless.tau > 1.3, "the shipped head must beat drafting nothing"
    for c in lossless.completions:
        assert c.behaviour_logprobs == pytest.approx(c.target_logprobs, abs=1e-5)
    mars = engine.generate(prompts * 2, sampling, SpecConfig(mode="chain", num_draft_tokens=5),
                           VerifierConfig("mars", {"theta": 0.9}), seed=1)
    assert any(any(c.relaxed) for c in mars.completions)


def test_mars_raises_greedy_acceptance(embedded):
    engine, _, prompts, eos = embedded
    sampling = SamplingParams(temperature=0, max_new_tokens=48, stop_token_ids=(eos,))
    spec = SpecConfig(mode="chain", num_draft_tokens=5)
    lossless = engine.generate(prompts, sampling, spec)
    mars = engine.generate(prompts, sampling, spec, VerifierConfig("mars", {"theta": 0.9}))
    assert mars.tau > lossless.tau
