"""The target's attention during the engine's forwards.

The engine always passes an explicit boolean mask ``[B, 1, T, L]`` (True = may attend: per-row
lengths, blocks, trees) and a cache whose slot ``s`` of a row holds position ``s``. The model's
own attention functions do not all take such a mask: ``eager`` adds the mask to the scores (a
boolean mask then adds 0 or 1 instead of -inf), ``sdpa`` repeats grouped kv heads whenever a mask
is given, and neither applies a layer's sliding window to a mask handed in (transformers builds
the window into the masks it makes itself). For the duration of a forward (:func:`engine_attention`)
the target's attention implementation is :func:`attend`, registered as ``ENGINE_ATTENTION`` (a
name ``rollout.kernels.fused_layers`` knows as plain attention), which computes what the model's own
attention computes over the engine's mask:

- **grouped kv heads** without materialising repeated keys/values (SDPA's ``enable_gqa``);
- **sliding windows**: a layer called with ``sliding_window=W`` (every transformers family passes
  its layer's window that way, None for full-attention layers) sees a key at position ``k`` from a
  query at position ``q`` only when ``q - k < W``, transformers' own rule; the positions are the
  forward's (:class:`Positions`);
- **attention soft-capping** (``softcap=c``: Gemma 2, Cohere 2...): scores ``c tanh(s / c)`` before
  the mask and the softmax, as the eager function does, with the softmax in float32.

Anything else a family passes its attention (attention sinks, chunked attention) is not
reproduced here; ``rollout.architectures`` refuses such models before the engine runs them."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ENGINE_ATTENTION = "rollout_engine_attention"


@dataclass(frozen=True)
class Positions:
    """The positions of one forward: ``query [B, T]`` of its tokens and ``key [B, L]`` of every
    key slot it attends over (only needed by layers with a sliding window)."""

    query: torch.Tensor
    key: torch.Tensor


_positions: contextvars.ContextVar[Positions | None] = contextvars.ContextVar("engine_positions", default=None)


def window_mask(mask: torch.Tensor, positions: Positions, window: int) -> torch.Tensor:
    """``mask [B, 1, T, L]`` restricted to keys less than ``window`` positions behind each query."""
    near = positions.query[:, :, None] - positions.key[:, None, :] < window  # [B, T, L]
    return mask & near[:, None]


def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None,
           softcap=None, **kwargs):
    """Attention over the engine's boolean mask. query ``[B, Hq, T, d]``, key/value ``[B, Hkv, L, d]``;
    returns ``[B, T, Hq, d]`` and None (no weights), as transformers' attention functions do."""
    assert attention_mask is not None and attention_mask.dtype == torch.bool, "the engine passes a boolean mask"
    assert kwargs.get("s_aux") is None, "attention sinks are not reproduced (rollout.architectures refuses them)"
    if sliding_window is not None:
        positions = _positions.get()
        assert positions is not None, "a sliding-window layer needs the forward's positions (engine_attention)"
        attention_mask = window_mask(attention_mask, positions, int(sliding_window))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, Hq, T, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def key_positions(lengths: torch.Tensor, query: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The position of every key slot ``[B, kv_len]`` of a forward whose block (positions ``query
    [B, T]``) sits at slots ``[length, length + T)`` of each row: a committed slot ``s`` holds
    position ``s``, a block slot the position of the block token written there."""
    slots = torch.arange(kv_len, device=query.device)[None, :]  # [1, L]
    rel = slots - lengths[:, None]  # [B, L]
    in_block = query.gather(1, rel.clamp(0, query.shape[1] - 1))
    return torch.where(rel < 0, slots, in_block)


@contextmanager
def engine_attention(target, positions: Positions | None = None):
    """Run the target's attention through :func:`attend` for the duration (any device, any
    configured implementation), with ``positions`` for its sliding-window layers."""
    from transformers import AttentionInterface

    config = target.model.config
    AttentionInterface.register(ENGINE_ATTENTION, attend)
    before = config._attn_implementation
    config._attn_implementation = ENGINE_ATTENTION
    token = _positions.set(positions)
    try:
        yield
    finally:
        _positions.reset(token)
        config._attn_implementation = before
