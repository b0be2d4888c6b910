"""Feature capture: ``Engine.generate(capture=True)`` returns, per row, the target's EAGLE-3
features and final-norm outputs at every position the target ran (plain decoding)."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import PROMPTS, single_thread, tiny_target  # noqa: F401

from rollout.engine.engine import Engine
from rollout.params import SamplingParams, SpecConfig


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_capture_is_the_targets_features_at_every_forwarded_position(single_thread, temperature):
    """Rows of different lengths, some stopping early: each capture equals one no-cache forward
    of prompt + completion[:-1] (features and final norm output), and lm_head(final) at the
    last prompt position and after is what the engine sampled from (greedy: its argmax)."""
    target = tiny_target()
    sampling = SamplingParams(temperature=temperature, max_new_tokens=9, stop_token_ids=(7, 11))
    res = Engine(target, num_threads=1).generate(PROMPTS, sampling, seed=3, capture=True)
    assert len(res.captures) == len(PROMPTS)
    for done, cap in zip(res.completions, res.captures):
        seq = done.prompt_ids + done.completion_ids
        assert cap.features.shape == (len(seq) - 1, 3 * target.hidden_size)
        assert cap.final.shape == (len(seq) - 1, target.hidden_size)
        with torch.no_grad():
            ref = target(torch.tensor([seq[:-1]]), use_cache=False, final=True)
        torch.testing.assert_close(cap.features, ref.features[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap.final, ref.final[0], rtol=1e-5, atol=1e-5)
        logits = target.model.get_output_embeddings()(cap.final)[len(done.prompt_ids) - 1:]
        if temperature == 0:
            assert logits.argmax(-1).tolist() == done.completion_ids
        else:
            lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(done.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(lp, torch.tensor(done.target_logprobs), rtol=1e-4, atol=1e-4)


def test_capture_changes_nothing_else(single_thread):
    target = tiny_target()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    engine = Engine(target, num_threads=1)
    a = engine.generate(PROMPTS, sampling, seed=5)
    b = engine.generate(PROMPTS, sampling, seed=5, capture=True)
    assert a.captures is None
    assert [c.completion_ids for c in a.completions] == [c.completion_ids for c in b.completions]
    assert [c.behaviour_logprobs for c in a.completions] == [c.behaviour_logprobs for c in b.completions]


def test_capture_needs_plain_decoding(single_thread):
    target = tiny_target()
    with pytest.raises(ValueError, match="capture needs plain decoding"):
        Engine(target, num_threads=1).generate(PROMPTS, spec=SpecConfig(mode="chain"), capture=True)
