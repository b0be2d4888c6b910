"""The V1 plug-in's log-prob channel (``rollout.vllm.plugin._logprobs_tensors``) without an
engine: column 0 carries the behaviour log-prob, the other columns the target log-prob, the rank
the (kind, relaxed) code; ``decode_completion`` reads back what was written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_column_zero_is_the_behaviour_log_prob_and_decodes_back():
    from rollout.vllm.backend import decode_completion
    from rollout.vllm.plugin import _logprobs_tensors

    out = {"tokens": torch.tensor([[5, 7, -1], [9, -1, -1]], dtype=torch.int32),
           "behaviour": torch.tensor([[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]]),
           "target": torch.tensor([[-0.75, -1.5, 0.0], [-2.5, 0.0, 0.0]]),
           "kinds": torch.tensor([[0, 1, -1], [2, -1, -1]]),
           "relaxed": torch.tensor([[True, False, False], [False, False, False]])}
    lp = _logprobs_tensors(out, 1)
    ids, lps, ranks = lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks
    assert lps.shape == (6, 2) and ids.shape == (6, 2)
    torch.testing.assert_close(lps[:, 0], out["behaviour"].flatten())
    torch.testing.assert_close(lps[:, 1], out["target"].flatten())
    # request 0's two tokens as vLLM hands them back (flat log-probs)
    flat = SimpleNamespace(start_indices=[0, 2], end_indices=[2, 4], token_ids=ids[:2].flatten().tolist(),
                           logprobs=lps[:2].flatten().tolist(), ranks=[int(ranks[0]), 0, int(ranks[1]), 0])
    c = decode_completion([1], SimpleNamespace(token_ids=[5, 7], logprobs=flat, finish_reason="length"))
    assert c.behaviour_logprobs == [-0.5, -1.25] and c.target_logprobs == [-0.75, -1.5]
    assert c.kinds == [0, 1] and c.relaxed == [True, False]
