"""The target's attention on the CPU during the engine's forwards: SDPA over grouped kv heads.

The engine always passes an explicit mask (per-row lengths, blocks, trees), and transformers'
own sdpa path repeats the keys and values of grouped kv heads whenever a mask is given. For the
duration of a forward (:func:`gqa_attention`), a target on the CPU with sdpa attention runs
:func:`sdpa_gqa` instead, registered as ``GQA_ATTENTION`` (a name ``rollout.fused_layers`` knows
as plain attention), which lets SDPA group the heads itself."""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn.functional as F

GQA_ATTENTION = "rollout_sdpa_gqa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA with grouped kv heads and a mask, without materialising repeated keys/values
    (transformers' own sdpa path repeats them whenever a mask is given). Outputs [B, T, H, D]."""
    assert attention_mask is not None, "the engine always passes an explicit mask"
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def gqa_attention(target):
    """On CPU, run the target's sdpa attention through :func:`sdpa_gqa` for the duration."""
    config = target.model.config
    if target.device.type != "cpu" or config._attn_implementation != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa)
    config._attn_implementation = GQA_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
