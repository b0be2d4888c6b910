"""The trainer's completion log-probs against a slow reference: each row run alone, its
full logits, the processed distribution read at each completion position. The fast path
sends only the positions from the first predicting one through lm_head, and rows that
repeat a prompt share one forward of it (its KV cache); values and gradients must be the
reference's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scripts.bench_train_step import AllPositions  # a forward that takes no logits_to_keep
from trainers.grpo.policy import completion_logprobs, forward_tokens, micro_batches
from verifiers import process_logits

PROMPTS = [[5, 9, 14, 3, 8, 21, 7], [11, 4, 6], [2, 3, 4, 5, 6, 7, 8, 9, 10, 12], [30, 31, 32, 33]]
OUTS = [[40, 41, 42], [43, 44, 45, 46, 47, 48], [49], []]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _reference(model, temperature, top_k, top_p, prompts=PROMPTS, outs=OUTS) -> torch.Tensor:
    rows = []
    for p, c in zip(prompts, outs):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids, use_cache=False).logits[0]  # every position
        lp = torch.log_softmax(process_logits(logits[len(p) - 1: len(p) - 1 + len(c)], temperature, top_k, top_p), -1)
        rows.append(lp.gather(-1, torch.tensor(c, dtype=torch.long).unsqueeze(-1)).squeeze(-1))
    width = max(len(c) for c in outs)
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


# GRPO-like rows: three prompts of different lengths, repeated in mixed order, completions of
# 0 to 7 tokens (a one-token prompt would leave nothing to share; it is tested below)
GROUPED_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
GROUPED_OUTS = [[40, 41, 42], [43, 44, 45, 46, 47, 48], [49], [50, 51, 52, 53, 54, 55, 56], [], [57, 58], [59]]


def _embedded_shapes(model, prompts, outs, net=None, **kwargs) -> list[tuple[int, ...]]:
    """The input shapes of each forward ``completion_logprobs`` makes (at the model's embedding)
    when it is given ``net`` (the model, or a wrapper of it)."""
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    with torch.no_grad():
        completion_logprobs(net or model, prompts, outs, temperature=1.0, **kwargs)
    hook.remove()
    return seen


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, 20, 0.9)])
def test_rows_sharing_a_prompt_match_the_reference(temperature, top_k, top_p):
    model = _model()
    # the three distinct prompts but their last token once (9 wide), then 7 rows x 7 positions
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS) == [(3, 9), (7, 7)]
    shared, mask = completion_logprobs(model, GROUPED_PROMPTS, GROUPED_OUTS, temperature=temperature,
                                       top_k=top_k, top_p=top_p)
    assert mask.tolist() == [[i < len(c) for i in range(7)] for c in GROUPED_OUTS]
    ref = _reference(model, temperature, top_k, top_p, GROUPED_PROMPTS, GROUPED_OUTS)
    torch.testing.assert_close(shared, ref, atol=1e-5, rtol=0)
    assert shared[mask].min() < -1.0

    grads = []
    for value in (shared, ref):
        model.zero_grad()
        (value * torch.arange(1, 8.0)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert grads[0].abs().max() > 1e-3


def test_rows_run_whole_where_nothing_is_shared():
    model = _model()
    whole = [(7, 17)]  # one forward over the 7 rows (10 + 7 wide)
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS, share_prompts=False) == whole
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS, net=AllPositions(model)) == whole  # no cache argument
    assert _embedded_shapes(model, PROMPTS, OUTS) == [(4, 11)]  # every prompt distinct
    one_token = [[7], [7], [7, 8], [7, 8]]
    outs = [[1, 2], [3], [4], [5, 6]]
    assert _embedded_shapes(model, one_token, outs) == [(4, 4)]  # a one-token prompt has no prefix to share
    with torch.no_grad():
        got, _ = completion_logprobs(model, one_token, outs, temperature=1.0)
    torch.testing.assert_close(got, _reference(model, 1.0, None, None, one_token, outs), atol=1e-5, rtol=0)


def test_forward_tokens_counts_what_each_path_runs():
    assert forward_tokens(GROUPED_PROMPTS, GROUPED_OUTS, shared=True) == 3 * 9 + 7 * 7
    assert forward_tokens(GROUPED_PROMPTS, GROUPED_OUTS, shared=False) == 7 * 17
    assert forward_tokens(PROMPTS, OUTS, shared=True) == 4 * 11  # nothing repeats


def test_micro_batches_cover_every_row_once_and_pick_the_cheaper_order():
    # two prompts of 40 tokens, 4 rows each, completions of 1-4 tokens interleaved so that
    # length order mixes the prompts and group order keeps them apart
    long_a, long_b = list(range(1, 41)), list(range(41, 81))
    prompts = [long_a, long_b] * 4
    outs = [[9] * k for k in (1, 1, 2, 2, 3, 3, 4, 4)]
    for shared in (True, False):
        cut = micro_batches(prompts, outs, 4, shared=shared)
        assert sorted(i for rows in cut for i in rows) == list(range(8)) and all(len(r) <= 4 for r in cut)
    grouped = micro_batches(prompts, outs, 4, shared=True)
    assert [sorted({tuple(prompts[i]) == tuple(long_a) for i in rows}) for rows in grouped] == [[True], [False]]
    # without sharing, rows of similar lengths: the two 1-token rows and the two 2-token ones together
    assert [sorted(len(outs[i]) for i in rows) for rows in micro_batches(prompts, outs, 4, shared=False)] == \
        [[1, 1, 2, 2], [3, 3, 4, 4]]
    # long completions on short prompts: length order pads less and wins with sharing too
    short = [[1, 2], [3, 4]] * 4
    longer = [[9] * k for k in (1, 30, 2, 31, 3, 32, 4, 33)]
    cut = micro_batches(short, longer, 4, shared=True)
    assert [sorted(len(longer[i]) for i in rows) for rows in cut] == [[1, 2, 3, 4], [30, 31, 32, 33]]
