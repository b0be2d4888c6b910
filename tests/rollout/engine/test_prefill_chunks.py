"""The prefill's chunks (``rollout.engine.chunking``) and the rows a sorted prefill hands back.

Sorting the prompts by length pads fewer tokens; the runner must still give every row its own
prompt's KV cache, last logits, draft features and captures. The reference prefills every row
alone (``prefill_tokens = 1``: no padding at all), so a row handed another row's prefill shows
as a difference of whole values, while the padding of a chunk only moves float rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import single_thread, tiny_target, trained_head  # noqa: F401

from rollout.engine.chunking import by_length, in_order, padded_tokens, prefill_chunks
from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig

# lengths 3..24, out of order, two prompts repeated (GRPO groups)
LENGTHS = [9, 24, 3, 17, 5, 24, 12, 3, 20, 7]
PROMPTS = [[(7 * i + 3 * j) % 60 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]
PROMPTS[5] = list(PROMPTS[1])  # the same prompt as row 1
PROMPTS[7] = list(PROMPTS[2])


def test_chunks_cover_every_row_once_within_the_budget():
    for lengths, budget in [(LENGTHS, 40), (LENGTHS, 1), (LENGTHS, 1000), ([5], 3), ([4, 4, 4], 8)]:
        for chunks in (in_order(lengths, budget), by_length(lengths, budget), prefill_chunks(lengths, budget)):
            assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
            assert all(c and (len(c) == 1 or len(c) * max(lengths[i] for i in c) <= budget) for c in chunks)


def test_sorting_is_taken_only_where_it_pads_fewer_tokens():
    # 50 tokens a chunk: 2 rows a chunk in the given order (50 // 24), padded to 194 tokens; sorted
    # [3 3 5 7 9] [12 17] [20 24] [24]: 151 (124 without padding)
    assert padded_tokens(in_order(LENGTHS, 50), LENGTHS) == 194
    assert padded_tokens(by_length(LENGTHS, 50), LENGTHS) == 151
    assert [LENGTHS[i] for c in prefill_chunks(LENGTHS, 50) for i in c] == sorted(LENGTHS)
    # 40 tokens: one row a chunk in the given order pads nothing, sorted chunks would: the given order
    assert prefill_chunks(LENGTHS, 40) == in_order(LENGTHS, 40) == [[i] for i in range(len(LENGTHS))]
    assert prefill_chunks(LENGTHS, 1000) == [list(range(len(LENGTHS)))]  # one chunk: the given order
    assert prefill_chunks([4, 4, 4], 8) == in_order([4, 4, 4], 8) == [[0, 1], [2]]  # a tie: the given order


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target()
    return target, trained_head(target, draft_vocab=48)


def _prefill(target, head, prefill_tokens: int, capture: bool = False, share: bool = True):
    runner = ModelRunner(target, head, prefill_tokens, capture, EngineOptions(share_prompts=share))
    with torch.inference_mode():
        logits = runner.start(PROMPTS, 40)
    return runner, logits


@pytest.mark.parametrize("share", [True, False], ids=["shared", "every-row"])
def test_sorted_prefill_gives_every_row_its_own_prompt(models, share, monkeypatch):
    target, head = models
    alone, ref_logits = _prefill(target, head, 1, share=share)
    assert alone.prefilled_rows == (8 if share else 10)
    seen = []
    chunk = ModelRunner._prefill_chunk

    def spy(self, ids, plen, rows):
        seen.append(plen.tolist())
        return chunk(self, ids, plen, rows)

    monkeypatch.setattr(ModelRunner, "_prefill_chunk", spy)
    runner, logits = _prefill(target, head, 50, share=share)
    assert [n for c in seen for n in c] == sorted({len(p) for p in PROMPTS} if share else LENGTHS)  # sorted
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for r, p in enumerate(PROMPTS):
        n = len(p)
        for kv, ref in zip((*runner.cache.keys, *runner.cache.values), (*alone.cache.keys, *alone.cache.values)):
            torch.testing.assert_close(kv[r, :, :n], ref[r, :, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(runner._waiting_feats[r, :n], alone._waiting_feats[r, :n], rtol=0, atol=1e-5)
    assert runner.cache.host_lengths == LENGTHS


def test_sorted_prefill_keeps_each_rows_captures(models):
    target, _ = models
    alone, _ = _prefill(target, None, 1, capture=True)
    runner, _ = _prefill(target, None, 50, capture=True)
    for (f, x), (f_ref, x_ref), n in zip(runner.captures(), alone.captures(), LENGTHS):
        assert f.shape[0] == x.shape[0] == n
        torch.testing.assert_close(f, f_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(x, x_ref, rtol=0, atol=1e-5)


def test_engine_outputs_follow_each_rows_prompt(models):
    """Greedy completions of a sorted prefill equal those of every prompt run on its own."""
    target, head = models
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    together = Engine(target, head, num_threads=1, prefill_tokens=50).generate(
        PROMPTS, sampling, SpecConfig(mode="chain", num_draft_tokens=3))
    for p, got in zip(PROMPTS, together.completions):
        alone = Engine(target, head, num_threads=1).generate([p], sampling, SpecConfig(mode="chain", num_draft_tokens=3))
        assert got.completion_ids == alone.completions[0].completion_ids
