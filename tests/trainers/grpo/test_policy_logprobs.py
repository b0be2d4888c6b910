"""The trainer's completion log-probs against a slow reference: each row run alone, its
full logits, the processed distribution read at each completion position. The fast path
sends only the positions from the first predicting one through lm_head, and rows that
repeat a prompt share one forward of it (its KV cache, or one packed sequence per prompt);
values and gradients must be the reference's whichever way runs."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scripts.research.bench_train_step import AllPositions  # a forward that takes no logits_to_keep
from trainers.grpo.policy import completion_logprobs, forward_paths
from verifiers import process_logits

PROMPTS = [[5, 9, 14, 3, 8, 21, 7], [11, 4, 6], [2, 3, 4, 5, 6, 7, 8, 9, 10, 12], [30, 31, 32, 33]]
OUTS = [[40, 41, 42], [43, 44, 45, 46, 47, 48], [49], []]


def _model(attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation=attention)
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


def _assert_same_gradients(model, got: torch.Tensor, ref: torch.Tensor) -> None:
    """The weights' gradients of a position-weighted sum of ``got`` and of ``ref`` (two separate
    graphs over the same weights) agree, and are not all near zero."""
    grads = []
    for value in (got, ref):
        model.zero_grad()
        (value * torch.arange(1.0, value.shape[1] + 1)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert grads[0].abs().max() > 1e-3


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

    _assert_same_gradients(model, fast, ref)


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
# the forwards each path makes over them (input shapes at the embedding): cached, the three
# prefixes (6, 2, 9 tokens) once and then 7 rows x 7 positions; packed, one sequence per prompt
# (6 + 3 + 1 + 2, 2 + 6 + 0, 9 + 7 + 1 positions)
SHAPES = {"whole": [(7, 17)], "cached": [(3, 9), (7, 7)], "packed": [(3, 17)]}


def _embedded_shapes(model, prompts, outs, net=None, **kwargs) -> list[tuple[int, ...]]:
    """The input shapes of each forward ``completion_logprobs`` makes (at the model's embedding)
    when it is given ``net`` (the model, or a wrapper of it)."""
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    with torch.no_grad():
        completion_logprobs(net or model, prompts, outs, temperature=1.0, **kwargs)
    hook.remove()
    return seen


@pytest.mark.parametrize("path, attention", [("cached", "sdpa"), ("packed", "sdpa"), ("packed", "eager"),
                                             ("whole", "sdpa")])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, 20, 0.9)])
def test_rows_sharing_a_prompt_match_the_reference(path, attention, temperature, top_k, top_p):
    model = _model(attention)
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS, path=path) == SHAPES[path]
    got, mask = completion_logprobs(model, GROUPED_PROMPTS, GROUPED_OUTS, temperature=temperature,
                                    top_k=top_k, top_p=top_p, path=path)
    assert mask.tolist() == [[i < len(c) for i in range(7)] for c in GROUPED_OUTS]
    ref = _reference(model, temperature, top_k, top_p, GROUPED_PROMPTS, GROUPED_OUTS)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert got[mask].min() < -1.0
    _assert_same_gradients(model, got, ref)


def test_the_paths_a_model_allows_and_the_errors():
    model = _model()
    assert forward_paths(model) == ("whole", "cached", "packed")
    assert forward_paths(model, share_prompts=False) == ("whole",)
    assert forward_paths(AllPositions(model)) == ("whole",)  # no cache, no config
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS, share_prompts=False) == SHAPES["whole"]
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS, net=AllPositions(model)) == SHAPES["whole"]
    # short completions: the packed group is the cheapest (forward_plan's estimate)
    assert _embedded_shapes(model, GROUPED_PROMPTS, GROUPED_OUTS) == SHAPES["packed"]
    with pytest.raises(ValueError, match="'cached' does not apply to this model"):
        completion_logprobs(AllPositions(model), GROUPED_PROMPTS, GROUPED_OUTS, temperature=1.0, path="cached")
    with pytest.raises(ValueError, match="'fast' is not one of"):
        completion_logprobs(model, GROUPED_PROMPTS, GROUPED_OUTS, temperature=1.0, path="fast")


def test_rows_run_whole_where_nothing_is_shared():
    model = _model()
    assert _embedded_shapes(model, PROMPTS, OUTS) == [(4, 11)]  # every prompt distinct
    one_token = [[7], [7], [7, 8], [7, 8]]
    outs = [[1, 2], [3], [4], [5, 6]]
    assert _embedded_shapes(model, one_token, outs) == [(4, 4)]  # a one-token prompt has no prefix to share
    with torch.no_grad():
        got, _ = completion_logprobs(model, one_token, outs, temperature=1.0)
    torch.testing.assert_close(got, _reference(model, 1.0, None, None, one_token, outs), atol=1e-5, rtol=0)
