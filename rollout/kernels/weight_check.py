"""Whether a packed copy of weights still holds them: the check ``rollout.kernels.native_linear.routed``
runs on entry, so a block always computes with the weights as they are.

A packed buffer (``native_linear.pack_merged``) is a copy: a weight changed after it was packed
must not go on computing from the old copy. What the buffer was packed from is stamped on it:

- its **source** (the caller's key, ``native_linear._source``: each weight's address, shape,
  version counter and int8 scales, and the packing switches). A new source always packs again.
- the weights' **digests** (``csrc/digest.cpp``: a 64-bit digest of their bytes). The version
  counter alone cannot tell: a write through ``.data`` (as some optimizers and weight loaders
  do) does not move it. So where the source is unchanged the digests are read again and the
  buffer is kept only if they equal the stamp's. All the jobs' digests are read in one
  :func:`digests` call, one pass of the threads over the weights' bytes (22-24 ms for
  SmolLM2-135M and its head on a 2-core Xeon, the rate of a plain sum; one parallel region per
  weight cost 8 ms more).
- A buffer packed because its weights' version moved is stamped **without** digests: reading
  them would cost every training step a pass over the weights. It is packed again, with
  digests, at the next check that finds the versions unchanged, and kept from then on.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rollout.kernels import native_lib

stamps = WeakIdKeyDictionary()  # owner (a weight or a fused module) -> (source, digests or None)
repacks = 0  # buffers packed (not kept) by refill_all so far: for tests and measurements


def digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a contiguous CPU tensor's bytes (``csrc/digest.cpp``): any change of
    one 8-byte word changes it; several changes leave it equal only by chance (about 2^-64)."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.stride())
    return int(native_lib.required().hr_digest(t.data_ptr(), t.numel() * t.element_size()))


def digests(ts: list[torch.Tensor]) -> list[int]:
    """:func:`digest` of each tensor, from one call (``hr_digest_many``: one pass of the threads
    over all their bytes, not one parallel region per tensor): the same values."""
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in ts)
    if not ts:
        return []
    n = len(ts)
    ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in ts))
    sizes = (ctypes.c_int64 * n)(*(t.numel() * t.element_size() for t in ts))
    out = (ctypes.c_uint64 * n)()
    native_lib.required().hr_digest_many(ptrs, sizes, n, out)
    return [int(d) for d in out]


def _due(owner, table: WeakIdKeyDictionary, source: tuple) -> bool:
    """Whether ``owner``'s buffer in ``table`` may be kept if its weights' digests still match:
    it exists and was packed from the same ``source``."""
    stamp = stamps.get(owner)
    return table.get(owner) is not None and stamp is not None and stamp[0] == source


def _refill(owner, table: WeakIdKeyDictionary, weights: list[torch.Tensor], source: tuple, sums: tuple | None,
            pack: Callable) -> torch.Tensor:
    """``owner``'s buffer in ``table``, kept when ``sums`` (the weights' digests, read because
    :func:`_due`) equal the stamp's, else packed again (``pack(weights, old_buffer)``) and
    stamped with ``source`` and ``sums``."""
    global repacks
    panels = table.get(owner)
    if sums is not None and sums == stamps[owner][1]:
        return panels
    panels = table[owner] = pack(weights, panels)
    stamps[owner] = (source, sums)
    repacks += 1
    return panels


def refill_all(jobs: list[tuple], pack: Callable, source_of: Callable) -> list[torch.Tensor]:
    """The buffer of each ``(owner, table, weights)`` job: kept where it was packed from the same
    ``source_of(weights)`` and the weights' bytes have the digests they had then, else packed
    again with ``pack`` (see the module docstring). The digests of every job that needs them
    are read in one :func:`digests` call."""
    sources = [source_of(weights) for _, _, weights in jobs]
    due = [_due(owner, table, source) for (owner, table, _), source in zip(jobs, sources)]
    flat = iter(digests([w for (_, _, weights), d in zip(jobs, due) if d for w in weights]))
    return [_refill(owner, table, weights, source, tuple(next(flat) for _ in weights) if d else None, pack)
            for (owner, table, weights), source, d in zip(jobs, sources, due)]
