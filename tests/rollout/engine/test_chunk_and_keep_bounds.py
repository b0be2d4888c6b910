"""Boundaries of the prefill's chunks (``rollout.engine.chunking``) and of ``RowKVCache.keep``."""

from __future__ import annotations

import torch

from rollout.engine.chunking import by_length, in_order
from rollout.engine.kv_cache import RowKVCache


def test_a_chunk_that_fills_the_budget_exactly_is_one_forward():
    assert by_length([4, 4, 4, 4], 16) == [[0, 1, 2, 3]]
    assert by_length([3, 5, 4, 2], 12) == [[3, 0, 2], [1]]  # 3 rows x 4 = 12 fits; 4 x 5 does not
    assert by_length([2, 3, 3], 9) == [[0, 1, 2]]
    assert in_order([4, 4, 4, 4, 4], 16) == [[0, 1, 2, 3], [4]]


def test_keep_of_every_row_in_another_order_moves_them():
    cache = RowKVCache(2, 3, 1, 2, 6, torch.float32, "cpu")
    for layer in range(2):
        for r in range(3):
            cache.keys[layer][r] = 10 * layer + r
            cache.values[layer][r] = -(10 * layer + r)
    cache.set_lengths(torch.tensor([2, 5, 3]))
    cache.keep([2, 0, 1])
    assert cache.host_lengths == [3, 2, 5] and cache.lengths.tolist() == [3, 2, 5]
    for layer in range(2):
        for i, r in enumerate([2, 0, 1]):
            n = cache.host_lengths[i]
            assert bool((cache.keys[layer][i, :, :n] == 10 * layer + r).all())
            assert bool((cache.values[layer][i, :, :n] == -(10 * layer + r)).all())
