"""The trainer's completion log-probs against a slow reference: each row run alone, its
full logits, the processed distribution read at each completion position. The fast path
sends only the positions from the first predicting one through lm_head; values and
gradients must be the reference's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scripts.bench_train_step import AllPositions  # a forward that takes no logits_to_keep
from trainers.grpo.policy import completion_logprobs
from verifiers import process_logits

PROMPTS = [[5, 9, 14, 3, 8, 21, 7], [11, 4, 6], [2, 3, 4, 5, 6, 7, 8, 9, 10, 12], [30, 31, 32, 33]]
OUTS = [[40, 41, 42], [43, 44, 45, 46, 47, 48], [49], []]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _reference(model, temperature, top_k, top_p) -> torch.Tensor:
    rows = []
    for p, c in zip(PROMPTS, OUTS):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids, use_cache=False).logits[0]  # every position
        lp = torch.log_softmax(process_logits(logits[len(p) - 1: len(p) - 1 + len(c)], temperature, top_k, top_p), -1)
        rows.append(lp.gather(-1, torch.tensor(c, dtype=torch.long).unsqueeze(-1)).squeeze(-1))
    width = max(len(c) for c in OUTS)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, 20, 0.9)])
def test_log_probs_and_gradients_match_the_row_by_row_reference(temperature, top_k, top_p):
    model = _model()
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    fast, mask = completion_logprobs(model, PROMPTS, OUTS, temperature=temperature, top_k=top_k, top_p=top_p)
    hook.remove()
    # the rows are 10 + 1 wide; the first completion token is predicted at position 2 (prompt of 3)
    assert seen == [11 - 2]
    assert mask.tolist() == [[i < len(c) for i in range(6)] for c in OUTS]
    ref = _reference(model, temperature, top_k, top_p)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)
    assert fast[mask].min() < -1.0  # real log-probs, not zeros

    grads = []
    for value in (fast, ref):  # two separate graphs over the same weights
        model.zero_grad()
        (value * torch.arange(1, 7.0)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert grads[0].abs().max() > 1e-3


def test_a_model_without_logits_to_keep_gets_the_same_values():
    model = _model()

    with torch.no_grad():
        fast, _ = completion_logprobs(model, PROMPTS, OUTS, temperature=1.0)
        full, _ = completion_logprobs(AllPositions(model), PROMPTS, OUTS, temperature=1.0)
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
