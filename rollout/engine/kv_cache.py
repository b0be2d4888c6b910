"""Pre-allocated, per-row KV caches for the speculative engine.

Vocabulary:
- **slot**: a position along the cache's sequence axis. Row b's committed tokens occupy
  slots ``[0, length[b])`` in order; every row has its own length.
- **block**: the T tokens of one forward. Row b writes them at slots
  ``[length[b], length[b] + T)``; the attention mask (built by the runner) decides which
  block slots each query sees (causal for chains, ancestors for trees).
- **commit**: after verification, the accepted part of the block becomes committed. For a
  chain it is a prefix of the block (nothing moves); for a tree the accepted path is
  gathered to the front of the block (``commit(path=...)``). Rejected slots lie beyond the
  new length and are simply overwritten by the next block: the cache never holds holes,
  so the prefix is never recomputed and never needs a separate compaction pass.
- **keep(rows)**: finished rows leave the batch; the kept rows are moved to the front in
  place (only the rows that move, and only their used slots, are copied) and the batch
  dimension shrinks. The engine fills each finished row's place with a live row from the end
  (:func:`fill_from_tail`): one row copied per finished row. The rows had been kept in
  order, every kept row copied twice (to a temporary and back) each time a row finished: at
  batch 64 (plain decoding, 64 tokens) 300 ms of a call's 4.2 s of decoding went to copying
  the cache, now 45.

:class:`RowKVCache` implements the transformers ``Cache`` interface that Hugging Face
attention layers call (``update``), so the target's own attention code writes into it.
The draft head keeps its cache in a one-layer ``RowKVCache`` as well.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class RowKVCache(Cache):
    """KV buffers ``[B, n_kv, capacity, head_dim]`` per layer with per-row lengths."""

    native_rows = True  # rollout.kernels.native_layers writes this layout (keys, values, _rows, _index, _kv_len)

    is_compileable = False

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        # Cache.__init__ is bypassed on purpose: it builds per-layer objects we do not use.
        self.layers: list = []
        self.num_layers = num_layers
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.host_lengths: list[int] = [0] * batch
        self._rows = slice(0, batch)
        self._index: torch.Tensor | None = None  # [B', n_kv, T, head_dim] scatter index
        self._kv_len = 0

    # -- the transformers Cache interface ------------------------------------------------
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.host_lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_len, 0

    def get_max_length(self) -> int:
        return self.capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the block's keys/values ``[B', n_kv, T, d]`` at each row's slots; return the
        visible prefix ``[B', n_kv, kv_len, d]`` (views, no copy)."""
        assert self._index is not None, "RowKVCache.prepare() must be called before a forward"
        k_buf = self.keys[layer_idx][self._rows]
        v_buf = self.values[layer_idx][self._rows]
        k_buf.scatter_(2, self._index, key_states.to(k_buf.dtype))
        v_buf.scatter_(2, self._index, value_states.to(v_buf.dtype))
        return k_buf[:, :, : self._kv_len], v_buf[:, :, : self._kv_len]

    # -- engine side -------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def prepare(self, block: int, rows: slice | None = None) -> tuple[torch.Tensor, int]:
        """Set up a forward of ``block`` tokens per row (all rows, or a contiguous row range);
        return the write slots ``[B', T]`` and the key length the forward attends over."""
        rows = rows or slice(0, self.batch)
        lengths = self.lengths[rows]
        kv_len = max(self.host_lengths[rows]) + block
        if kv_len > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({kv_len} slots needed)")
        slots = lengths[:, None] + torch.arange(block, device=lengths.device)  # [B', T]
        k0 = self.keys[0]
        self._index = slots[:, None, :, None].expand(slots.shape[0], k0.shape[1], block, k0.shape[3])
        self._rows, self._kv_len = rows, kv_len
        return slots, kv_len

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Make ``lengths [B]`` the committed lengths (after a prefill)."""
        self.lengths = lengths.to(self.lengths.device, torch.long).clone()
        self.host_lengths = self.lengths.tolist()

    def commit(self, counts: torch.Tensor, host_counts: list[int], path: torch.Tensor | None = None) -> None:
        """Commit ``counts [B]`` block tokens per row. ``path [B, W]`` (block offsets, increasing,
        the first ``counts[b]`` valid) gathers a tree's accepted path to the block's front."""
        if path is not None:
            self._gather_path(path)
        self.lengths += counts.to(self.lengths.device)
        self.host_lengths = [a + b for a, b in zip(self.host_lengths, host_counts)]

    def _gather_path(self, path: torch.Tensor) -> None:
        b, w = path.shape
        src = self.lengths[:, None] + path  # [B, W]
        dst = self.lengths[:, None] + torch.arange(w, device=path.device)  # [B, W]
        k0 = self.keys[0]
        shape = (b, k0.shape[1], w, k0.shape[3])
        src_idx = src[:, None, :, None].expand(shape)
        dst_idx = dst[:, None, :, None].expand(shape)
        for buf in (*self.keys, *self.values):
            moved = buf.gather(2, src_idx)  # [B, n_kv, W, d]
            buf.scatter_(2, dst_idx, moved)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (distinct, in any order): kept row ``rows[i]`` becomes row i. Only
        the rows that move are copied (their used slots); the others stay where they are, so
        filling the places of finished rows with rows from the end
        (:func:`fill_from_tail`) moves one row per finished row, not the whole cache."""
        if rows == list(range(self.batch)):
            return
        moves = [(i, r) for i, r in enumerate(rows) if r != i]
        used = max((self.host_lengths[r] for _, r in moves), default=0)
        n = len(rows)
        if moves and used:
            device = self.lengths.device
            dst = torch.tensor([i for i, _ in moves], dtype=torch.long, device=device)
            src = torch.tensor([r for _, r in moves], dtype=torch.long, device=device)
            for buf in (*self.keys, *self.values):
                view = buf[:, :, :used]
                view.index_copy_(0, dst, view.index_select(0, src))  # (a copy of the moved rows first)
        self.keys = [buf[:n] for buf in self.keys]
        self.values = [buf[:n] for buf in self.values]
        idx = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.lengths = self.lengths.index_select(0, idx)
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self._index = None

    def kv(self, layer_idx: int = 0, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` slots (default: the longest row) of one layer."""
        length = max(self.host_lengths, default=0) if length is None else length
        return self.keys[layer_idx][:, :, :length], self.values[layer_idx][:, :, :length]


def fill_from_tail(done: list[bool]) -> list[int]:
    """The rows to keep when the rows flagged ``done`` finish, in their new order: live rows
    stay in place, and the place of each finished row among the first ``n`` (the live count)
    is taken by a live row from beyond them, in order."""
    n = done.count(False)
    tail = iter(r for r in range(n, len(done)) if not done[r])
    return [i if not done[i] else next(tail) for i in range(n)]
