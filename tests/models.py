"""Tiny models shared by the engine and drift tests: a random 4-layer Llama whose layers after the
first are damped, and a "copy" EAGLE-3 head (the layer-1 feature through the target's own final
norm and lm_head, its decoder layer nearly silent)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.eagle3 import Eagle3Config, Eagle3Head
from rollout.models import TargetModel


def tiny_target(vocab: int = 64, seed: int = 0, logit_scale: float = 3.0, context: int = 256) -> TargetModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=context, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return TargetModel(model)


def copy_head(target: TargetModel, draft_vocab: int | None = None, seed: int = 1, noise: float = 0.0) -> Eagle3Head:
    """An EAGLE-3 head that reuses the target's norm and lm_head on the layer-1 feature; ``noise``
    perturbs its lm_head (relative to the weights' std) so that q is close to p but not equal."""
    torch.manual_seed(seed)
    v, h = target.vocab_size, target.hidden_size
    vd = draft_vocab or v
    cfg = Eagle3Config(hidden_size=h, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=v, draft_vocab_size=vd, target_hidden_size=h,
                       aux_layer_ids=target.aux_layer_ids)
    head = Eagle3Head(cfg, target.embed_tokens).eval()
    ids = torch.randperm(v)[:vd].sort().values
    head.set_draft_vocab(ids)
    which = list(target.aux_layer_ids).index(1)  # the feature block holding the input of layer 1
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, which * h:(which + 1) * h] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.mul_(0.05)
        head.midlayer.mlp.down_proj.weight.mul_(0.05)
        head.norm.weight.copy_(target.model.model.norm.weight)
        w = target.model.lm_head.weight[ids]
        if noise:
            w = w + noise * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
        head.lm_head.weight.copy_(w)
    return head
