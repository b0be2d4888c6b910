"""RowKVCache.keep and the engine's order of kept rows."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.kv_cache import RowKVCache, fill_from_tail


def test_fill_from_tail_moves_one_live_row_per_finished_place():
    assert fill_from_tail([False, True, False, False, True, False]) == [0, 5, 2, 3]
    assert fill_from_tail([True, True, False, False, False]) == [3, 4, 2]
    assert fill_from_tail([False, False, True, True]) == [0, 1]
    assert fill_from_tail([False] * 3) == [0, 1, 2]
    assert fill_from_tail([True] * 3) == []
    done = [bool(x) for x in torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(0))]
    rows = fill_from_tail(done)
    assert sorted(rows) == [r for r, d in enumerate(done) if not d]  # every live row, once
    assert all(r == i for i, r in enumerate(rows) if not done[i])  # live rows in place stay


def _filled_cache(batch: int, lengths: list[int]) -> RowKVCache:
    cache = RowKVCache(2, batch, 3, 4, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    for buf in (*cache.keys, *cache.values):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    cache.set_lengths(torch.tensor(lengths))
    return cache


@pytest.mark.parametrize("rows", [[0, 5, 2, 3], [3, 4, 2], [4, 0, 2], [1, 2, 3, 4, 5], [5]])
def test_keep_moves_each_kept_row_whole(rows):
    """Kept row rows[i] becomes row i with its used slots and length, in any order (the source
    rows of a move may be destinations of another)."""
    lengths = [3, 9, 5, 12, 7, 10]
    cache = _filled_cache(6, lengths)
    before = [(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values)]
    cache.keep(rows)
    assert cache.batch == len(rows) and cache.host_lengths == [lengths[r] for r in rows]
    assert cache.lengths.tolist() == [lengths[r] for r in rows]
    for (k0, v0), k, v in zip(before, cache.keys, cache.values):
        for i, r in enumerate(rows):
            n = lengths[r]
            assert torch.equal(k[i, :, :n], k0[r, :, :n]) and torch.equal(v[i, :, :n], v0[r, :, :n])


def test_a_forward_that_fills_the_capacity_exactly_fits():
    """``prepare`` takes a block whose last slot is the cache's last (kv_len == capacity) and
    refuses one slot more, naming the slots needed."""
    cache = RowKVCache(1, 2, 1, 2, 10, torch.float32, "cpu")
    cache.set_lengths(torch.tensor([4, 7]))
    slots, kv_len = cache.prepare(3)
    assert kv_len == 10 and slots.tolist() == [[4, 5, 6], [7, 8, 9]]
    with pytest.raises(RuntimeError, match=r"capacity 10 exceeded \(11 slots needed\)"):
        cache.prepare(4)
