"""The trainer's forward plan: what each way of running a micro-batch costs (closed forms from
the model's shape), which one it picks, and how the rows are cut into micro-batches."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from trainers.grpo.forward_plan import (ForwardCost, choose_path, distinct_prompts, micro_batches,
                                        packed_lengths, path_costs)

SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_cost_of_a_forward_from_the_model_shape():
    cost = ForwardCost.of(SMOL)
    # q, k, v (9 + 3 + 3 heads of 64), o, and the three MLP matrices, per layer
    assert cost.per_token == 30 * (576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536)
    assert cost.per_pair == 2 * 30 * 9 * 64  # q.k and the weighted sum of v, every head and layer
    assert cost.forward(2, 10) == 2 * 10 * (cost.per_token + 10 * cost.per_pair)
    assert cost.forward(2, 10, keys=30) == 2 * 10 * (cost.per_token + 30 * cost.per_pair)


def test_path_costs_are_the_closed_forms():
    cost = ForwardCost(per_token=100.0, per_pair=1.0)
    prompts = [[1, 2, 3, 4], [5, 6], [1, 2, 3, 4], [5, 6]]
    outs = [[7, 8, 9], [7], [], [7, 8]]
    assert distinct_prompts(prompts) == ([(1, 2, 3, 4), (5, 6)], [0, 1, 0, 1])
    assert packed_lengths(prompts, outs) == [3 + 3 + 0, 1 + 1 + 2]
    costs = path_costs(prompts, outs, cost)
    assert costs == {"whole": 4 * 7 * (100 + 7), "cached": 2 * 3 * (100 + 3) + 4 * 3 * (100 + 6),
                     "packed": 2 * 6 * (100 + 6)}
    assert choose_path(prompts, outs, cost) == ("packed", costs["packed"])
    assert choose_path(prompts, outs, cost, ("whole", "cached")) == ("cached", costs["cached"])
    # nothing to share: distinct prompts, or a one-token prompt
    assert path_costs([[1, 2], [3, 4]], [[5], [6]], cost).keys() == {"whole"}
    assert path_costs([[1], [1]], [[5], [6]], cost).keys() == {"whole"}
    with pytest.raises(ValueError, match="no path of"):
        choose_path([[1], [1]], [[5], [6]], cost, ("packed",))


def test_packing_pays_for_short_completions_and_the_cache_for_long_ones():
    cost = ForwardCost.of(SMOL)
    prompt = list(range(1, 66))
    # make run's shape: 8 samples of 12-64 tokens; packed, 64 + 316 positions and no padding,
    # against the cached prompt's 8 x 64 completion positions
    varied = [[9] * k for k in (12, 20, 28, 36, 44, 52, 60, 64)]
    assert choose_path([prompt] * 8, varied, cost)[0] == "packed"
    # of equal lengths, nothing is padded, and the cache attends to fewer keys
    assert choose_path([prompt] * 8, [[9] * 40] * 8, cost)[0] == "cached"
    # 8 samples of 512 tokens: a 4160-position packed sequence would spend more on attention
    # (most of it masked) than the cached prompt spends on everything
    long = [[9] * 512] * 8
    assert choose_path([prompt] * 8, long, cost)[0] == "cached"
    costs = path_costs([prompt] * 8, long, cost)
    assert costs["packed"] > costs["whole"] > costs["cached"]


def test_micro_batches_cover_every_row_once_and_pick_the_cheaper_order():
    cost = ForwardCost(per_token=100.0, per_pair=0.0)  # positions only
    # two prompts of 40 tokens, 4 rows each, completions of 1-4 tokens interleaved so that
    # length order mixes the prompts and group order keeps them apart
    long_a, long_b = list(range(1, 41)), list(range(41, 81))
    prompts = [long_a, long_b] * 4
    outs = [[9] * k for k in (1, 1, 2, 2, 3, 3, 4, 4)]
    for paths in (("whole",), ("whole", "cached", "packed")):
        cut = micro_batches(prompts, outs, 4, cost=cost, paths=paths)
        assert sorted(i for rows in cut for i in rows) == list(range(8)) and all(len(r) <= 4 for r in cut)
    grouped = micro_batches(prompts, outs, 4, cost=cost)
    assert [sorted({tuple(prompts[i]) == tuple(long_a) for i in rows}) for rows in grouped] == [[True], [False]]
    # whole rows only: rows of similar lengths, the two 1-token rows and the two 2-token ones together
    assert [sorted(len(outs[i]) for i in rows) for rows in micro_batches(prompts, outs, 4, cost=cost,
                                                                         paths=("whole",))] == [[1, 1, 2, 2], [3, 3, 4, 4]]
    # long completions on short prompts: length order pads less, whatever the paths
    short = [[1, 2], [3, 4]] * 4
    longer = [[9] * k for k in (1, 30, 2, 31, 3, 32, 4, 33)]
    cut = micro_batches(short, longer, 4, cost=cost)
    assert [sorted(len(longer[i]) for i in rows) for rows in cut] == [[1, 2, 3, 4], [30, 31, 32, 33]]
