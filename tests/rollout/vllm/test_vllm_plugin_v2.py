"""The V2 (CUDA, vllm 0.33) plug-in's layout mapping on stand-ins for vLLM's V2 sampler: no
vLLM, no GPU. The real V2 engine has not been run; this checks that the V2 layout (per-request
logits rows, input tokens per row, draft logits by request-state index) reaches ``verify_chain``
as the V1 path does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from rollout.vllm import plugin_v2, verify
from verifiers import get_rule, verify_chain

V, K = 10, 3


def _sampler(temps: torch.Tensor):
    """A V2 Sampler's state with no setting our verifier leaves out (no penalties, min_p, logits
    processors or thinking budget)."""
    n = temps.shape[0]
    states = SimpleNamespace(temperature=SimpleNamespace(gpu=temps), top_k=None, top_p=None,
                             min_p=SimpleNamespace(np=np.zeros(n, np.float32)))
    penalties = SimpleNamespace(presence_penalty=SimpleNamespace(np=np.zeros(n)),
                                frequency_penalty=SimpleNamespace(np=np.zeros(n)),
                                repetition_penalty=SimpleNamespace(np=np.ones(n)))
    return SimpleNamespace(sampling_states=states, apply_sampling_params=lambda logits, *a: logits,
                           penalties_state=penalties, logits_processors=[],
                           thinking_budget_state=SimpleNamespace(enabled=False))


def test_v2_verify_matches_verify_chain_per_request():
    g = torch.Generator().manual_seed(0)
    r = 3
    idx_mapping = torch.tensor([5, 2, 7])  # request-state indices
    temps = torch.full((8,), 0.9)
    logits = torch.randn(r * (K + 1), V, generator=g) * 2  # raw, K + 1 rows per request
    draft_logits = torch.randn(8, K, V, generator=g) * 2  # raw, by request-state index
    q = torch.softmax(draft_logits[idx_mapping] / 0.9, -1)  # [r, K, V]
    x = torch.multinomial(q.view(-1, V), 1, generator=g).view(r, K)
    inputs = torch.cat([torch.full((r, 1), 4), x], 1).flatten()  # row 0: the last accepted token
    cu = torch.arange(r + 1) * (K + 1)
    self = SimpleNamespace(sampler=_sampler(temps), num_speculative_steps=K, watermark_key=None)
    rule = get_rule("mars", theta=0.5)
    verify.STATE.rule, verify.STATE.generator, verify.STATE.seed, verify.STATE.record = rule, None, 3, None
    try:
        _, sampled, num_sampled = plugin_v2._verify(self, logits, draft_logits, inputs, None, cu, idx_mapping,
                                                    idx_mapping.numpy(), None, None, None, inputs)
    finally:
        verify.STATE.rule = None
    exp = verify_chain(rule, logits.view(r, K + 1, V), draft_logits[idx_mapping], x, temperature=0.9,
                       generator=torch.Generator().manual_seed(3))
    assert sampled.shape == (r, K + 1)
    assert sampled.long().tolist() == exp.tokens.tolist()
    assert num_sampled.tolist() == exp.num_emitted.tolist()
    lp = plugin_v2._LAST["out"]
    torch.testing.assert_close(lp["behaviour"], exp.behaviour_logprobs, atol=1e-5, rtol=0)


def test_v2_refuses_placeholder_drafts():
    """vLLM V2 marks a draft slot -1 (a request in a remote prefill, a grammar-refused draft); the
    walk must not treat it as token 0 and verify the next row against the wrong context."""
    import pytest

    r = 2
    idx_mapping = torch.tensor([0, 1])
    logits = torch.randn(r * (K + 1), V)
    draft_logits = torch.randn(2, K, V)
    inputs = torch.tensor([4, 1, 2, 3, 4, 1, -1, -1])
    cu = torch.arange(r + 1) * (K + 1)
    self = SimpleNamespace(sampler=_sampler(torch.full((2,), 0.9)), num_speculative_steps=K,
                           watermark_key=None)
    verify.STATE.rule, verify.STATE.generator, verify.STATE.seed, verify.STATE.record = get_rule("lossless"), None, 3, None
    try:
        with pytest.raises(RuntimeError, match="placeholder drafts"):
            plugin_v2._verify(self, logits, draft_logits, inputs, None, cu, idx_mapping, idx_mapping.numpy(), None,
                              None, None, inputs)
    finally:
        verify.STATE.rule = None
