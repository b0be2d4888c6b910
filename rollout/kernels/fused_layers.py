"""Decoding-time forwards of Llama-style layers with fewer ops (inside ``native_linear.routed``).

At batch 1 a SmolLM2-135M step runs about 1300 small ops besides its 211 linear layers, and on
this project's 2-core CPU their dispatch costs about a fifth of the step. Inside an engine call
(the native linear kernel in use), these modules run a leaner forward with the same arithmetic:

- **RMS norms** (Llama's formula, fp32): ``csrc/norm.cpp`` (``native_ops.rms_norm``, handed in
  by ``native_linear.routed``), one call of ~1 us instead of torch's 14-28 us (61 norms a
  SmolLM2 step): batch-invariant, equal to the module's own up to float32 rounding of the sum of
  squares. Without it (``EngineOptions(native_norm=False)``, or where it does not fit)
  ``torch.nn.functional.rms_norm``, one op instead of seven, the same bits as the module's own
  (on the shapes tested).
- **Attention** (Llama/Mistral: no biases, no q/k norms): q, k and v come from one kernel call
  over their weights packed side by side (each output column is summed in the kernel's fixed
  order, so the values are those of three calls), and the rotary embedding rotates q and k
  together in four ops. ``x * cos + rotate_half(x) * sin`` becomes
  ``x * cos + swap_halves(x) * sin'`` with ``sin'`` the sine with its first half negated: the
  same products, so the same bits. With a mask (the engine always passes one) and plain
  softmax attention, the attention itself runs ``csrc/attention.cpp``
  (``native_ops.attend``, which ``native_linear.routed`` hands in: this module calls no
  kernel of its own): 2-3x cheaper than torch's at batch 16, batch-invariant, and equal to
  torch's up to float32 rounding (with the norms, the only parts of this module that are not the
  same bits).
- **MLP** (gate/up/down with SiLU): gate and up from one kernel call, ``down(silu(g) * u)``.
- **The EAGLE-3 head's attention** (``rollout.eagle3_head.DraftAttention``): as Llama's (q/k/v
  from one call, q and k rotated together, ``csrc/attention.cpp`` over the grouped kv heads
  instead of repeating them); about a fifth of a batch-1 draft step.
- **The decoder stack** (``LlamaModel`` / ``MistralModel`` whose every layer runs the forwards
  above): :func:`stack_forward` runs embedding, rotary tables, the layers and the final norm as
  one loop that calls those forwards directly, the same ops in the same order as the model's own
  forward (the same bits), without the per-module call machinery, the output-capturing and
  mask-preparing wrappers and the feature hooks (the loop keeps the aux layers' inputs itself):
  about 2.5 ms of a 25 ms batch-1 SmolLM2-135M step. Any hook on a layer or its parts (or a
  global one) keeps the model's own forward.
- **Each layer in one C++ call** (``csrc/layer.cpp``, :mod:`rollout.kernels.native_layers`, handed in as
  ``stack_forward``'s ``layer_kernel``): inside that loop, with
  the engine's cache (``RowKVCache``), the native norms and the attention kernel's conditions,
  a layer's norm, q/k/v, rotation, cache write, attention, o projection, residual, norm,
  gate/up, SiLU (ATen's kernel), product, down projection and residual run from one call, the
  same arithmetic in the same order: the same bits as the Python forwards (tests compare with
  ``torch.equal``), without ~40 op dispatches per layer. On an Intel Xeon (2 cores) a batch-1
  SmolLM2-135M forward went from 36.5 to 26.0 ms, a 4-token block from 40.8 to 29.6, batch 16
  from 64.3 to 46.3 ms (one process, forwards interleaved).

Anything else (other dtypes, autograd, too many rows for the kernel, other module classes,
head sizes other than 16/32/64/128) keeps the module's own forward or computes the torch way.
The tests compare the logits, log-probs and tokens of this path with the torch path
(``Engine(linear="torch")``, which never enters here) and with the modules' own forwards
(``EngineOptions(fused=False)``). The engine's options (``rollout.options.EngineOptions``)
reach this module as arguments: ``native_linear.routed`` decides which forwards to patch, and
:func:`stack_forward` takes them from the model runner.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from rollout.options import EngineOptions

DEFAULTS = EngineOptions()
_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> its checked layers (or None), this block
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "RMSNorm"})
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention"})
DRAFT_ATTENTIONS = frozenset({"DraftAttention"})  # rollout.eagle3_head's (the EAGLE-3 head's layer)
# attention implementations that compute softmax(q k^T * scale, masked) v and nothing else (the
# first is the engine's own, rollout.engine.attention's)
PLAIN_ATTENTION = frozenset({"rollout_engine_attention", "sdpa", "eager"})
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "DraftMLP"})
# decoder stacks and layers whose forward is: embed, rotary tables, for each layer x += attn(norm(x)),
# x += mlp(norm(x)), then the final norm (a 4D mask is used as given)
STACKS = frozenset({"LlamaModel", "MistralModel"})
DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer"})


def _norm_eps(module: nn.Module) -> float | None:
    """The epsilon of a Llama-formula RMS norm (``weight * x * rsqrt(mean(x^2) + eps)``), else None."""
    if not _known(module, NORMS):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    return eps


def _known(module: nn.Module, names: frozenset[str]) -> bool:
    """A class of ``names`` from transformers or from this project (whose formulas are known)."""
    cls = type(module)
    return cls.__name__ in names and cls.__module__.split(".")[0] in ("transformers", "rollout")


def _windowed(module: nn.Module) -> bool:
    """A module of a model with sliding-window attention (its forward passes the window to the
    attention function, which ``rollout.engine.attention`` applies; the fused forwards do not)."""
    return getattr(getattr(module, "config", None), "sliding_window", None) is not None


def _bias_free(*layers) -> bool:
    return all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers)


def _silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return type(module).__name__ == "DraftMLP" or isinstance(act, nn.SiLU) or (
        type(act).__name__ == "SiLUActivation" and type(act).__module__ == "transformers.activations")


def merged_groups(module: nn.Module) -> list[nn.Linear] | None:
    """The linear layers whose outputs a fused forward of ``module`` computes in one kernel call
    (attention: q, k, v; MLP: gate, up), or None when ``module`` is not fused."""
    attention = (_known(module, ATTENTIONS) and not hasattr(module, "q_norm") and not _windowed(module)) or _known(
        module, DRAFT_ATTENTIONS)
    if attention and _bias_free(module.q_proj, module.k_proj, module.v_proj, module.o_proj):
        return [module.q_proj, module.k_proj, module.v_proj]
    if _known(module, MLPS) and _silu(module) and _bias_free(module.gate_proj, module.up_proj, module.down_proj):
        return [module.gate_proj, module.up_proj]
    return None


def norm_forward(module: nn.Module, kernel=None):
    """The fused forward of an RMS norm module, or None. ``kernel(x, weight, eps)``:
    ``native_ops.rms_norm`` (None where it does not fit; then torch's ``rms_norm``); None: torch's
    ``rms_norm`` always (``native_linear.routed`` passes None under ``EngineOptions(native_norm=False)``)."""
    eps = _norm_eps(module)
    if eps is None:
        return None
    original = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or module.weight.dtype != torch.float32:
            return original(module, x)
        out = kernel(x, module.weight, eps) if kernel is not None else None
        return out if out is not None else F.rms_norm(x, (x.shape[-1],), module.weight, eps)

    return forward


def fused_forward(module: nn.Module, merged, attend):
    """The fused forward of an attention or MLP module (``merged(x)``: the concatenated outputs
    of :func:`merged_groups`'s layers; ``attend``: ``native_ops.attend``, the attention
    kernel, which returns None where it does not fit)."""
    if type(module).__name__ in ATTENTIONS:
        return functools.partial(_attention, module, merged, attend)
    if type(module).__name__ in DRAFT_ATTENTIONS:
        return functools.partial(_draft_attention, module, merged, attend)
    return functools.partial(_mlp, module, merged)


def _mlp(module: nn.Module, merged, x: torch.Tensor) -> torch.Tensor:
    gate_up = merged(x)
    inner = module.gate_proj.out_features
    return module.down_proj(F.silu(gate_up[..., :inner]) * gate_up[..., inner:])


_last_rotary: tuple = (None, None, None)  # (sin, cos [B, T, 1, d], signed sin [B, T, 1, d]) of the last forward


def _rotary(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the sine with its first half negated, ``[B, T, 1, d]``: computed once per forward
    (every layer of a forward gets the same ``position_embeddings`` tensors)."""
    global _last_rotary
    cos, sin = position_embeddings  # [B, T, d]
    last = _last_rotary
    if last[0] is sin:
        return last[1], last[2]
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(-2)
    _last_rotary = (sin, cos.unsqueeze(-2), signed)
    return _last_rotary[1], _last_rotary[2]


def _attention(module: nn.Module, merged, attend_native, hidden_states: torch.Tensor, position_embeddings=None,
               attention_mask=None, cache=None, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if cache is None:  # older transformers (5.19, vLLM's pin) pass the cache as past_key_values
        cache = kwargs.pop("past_key_values", None)
    lead = hidden_states.shape[:-1]  # [B, T]
    d = module.head_dim
    n_q, n_kv = module.q_proj.out_features // d, module.k_proj.out_features // d
    qkv = merged(hidden_states)  # [B, T, (n_q + 2 n_kv) d]
    qk = qkv[..., : (n_q + n_kv) * d].view(*lead, n_q + n_kv, d)
    cos, signed_sin = _rotary(position_embeddings)
    swapped = qk.view(*lead, n_q + n_kv, 2, d // 2).flip(-2).view(*lead, n_q + n_kv, d)
    qk = qk * cos + swapped * signed_sin
    query = qk[..., :n_q, :].transpose(1, 2)  # [B, n_q, T, d]
    key = qk[..., n_q:, :].transpose(1, 2)
    value = qkv[..., (n_q + n_kv) * d:].view(*lead, n_kv, d).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    if (module.config._attn_implementation in PLAIN_ATTENTION and not module.training and attention_mask is not None
            and getattr(module.config, "sliding_window", None) is None):
        out = attend_native(query, key, value, attention_mask, module.scaling)  # None: does not fit
        if out is not None:
            return module.o_proj(out.view(*lead, -1)), None
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    out, weights = attend(module, query, key, value, attention_mask,
                          dropout=0.0 if not module.training else module.attention_dropout,
                          scaling=module.scaling, **kwargs)
    return module.o_proj(out.reshape(*lead, -1).contiguous()), weights


def _draft_attention(module: nn.Module, merged, attend, x: torch.Tensor, rotary, position_ids, attn_mask, past):
    """The EAGLE-3 head's attention (``rollout.eagle3_head.DraftAttention``): q, k and v from one
    kernel call, q and k rotated together (the rotation is the same per head, so the same bits),
    and the grouped-query attention through ``csrc/attention.cpp`` without repeating the kv
    heads; returns what the module returns (the output and the full keys and values)."""
    b, t, _ = x.shape
    nh, nkv, d = module.nh, module.nkv, module.d
    qkv = merged(x)  # [B, T, (nh + 2 nkv) d]
    qk = rotary(qkv[..., : (nh + nkv) * d].view(b, t, nh + nkv, d).transpose(1, 2), position_ids)
    q, k = qk[:, :nh], qk[:, nh:]  # [B, nh, T, d], [B, nkv, T, d]
    v = qkv[..., (nh + nkv) * d:].view(b, t, nkv, d).transpose(1, 2)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, nkv, L, d]
    else:  # one layout for both (the kernel's condition), as the concatenation gives them
        k, v = k.contiguous(), v.contiguous()
    out = attend(q, k, v, attn_mask[:, None], d ** -0.5) if not module.training else None
    if out is None:  # does not fit the kernel: the module's own arithmetic
        out = module.attend(q, k, v, attn_mask)
    return module.o_proj(out.reshape(b, t, nh * d)), (k, v)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def stack_forward(base: nn.Module, layer_kernel=None, options: EngineOptions = DEFAULTS):
    """The decoder stack of ``base`` (a ``LlamaModel``, the body of a causal LM) as one loop, or
    None where it does not apply (then run the model's own forward): called as
    ``run(input_ids [B, T], position_ids [B, T], mask [B, 1, T, L] bool, cache, keep)``, it
    returns the final norm's output ``[B, T, H]`` and ``{i: input of layer i}`` for i in
    ``keep``. Applies inside ``native_linear.routed`` (every layer's norms, attention and MLP
    running the forwards above), without autograd, in eval mode, with no hooks to run. The
    layers are checked once per ``routed`` block (:func:`new_block`; checking every layer's parts
    cost about 0.4 ms of a 14 ms batch-1 forward): a hook registered on a layer inside a block
    takes effect from the next block, as the weights do.

    layer_kernel: runs all the layers at once where it can (``rollout.kernels.native_layers.run``: each
    layer in one C++ call), called as ``layer_kernel(base, layers, hidden, position_embeddings,
    mask, cache, keep)``; it returns what the loop would, or None (then the loop runs).

    options: the engine's (``rollout.options.EngineOptions``); with ``fused`` or
    ``fused_stack`` off, None (the model's own forward around whatever forwards are in place)."""
    from torch.nn.modules import module as module_state

    if (not (options.fused and options.fused_stack) or not _known(base, STACKS) or _windowed(base) or base.training
            or torch.is_grad_enabled()
            or module_state._global_forward_hooks or module_state._global_forward_pre_hooks
            or _hooked(base) or _hooked(base.norm) or "forward" not in base.norm.__dict__):
        return None
    if base not in _stacks:
        _stacks[base] = _stack_layers(base)
    layers = _stacks[base]
    return functools.partial(_run_stack, base, layers, layer_kernel) if layers is not None else None


def new_block() -> None:
    """Forget the checked layers (``native_linear.routed`` calls this as a block starts: its modules'
    forwards and hooks are checked again at their first stack forward)."""
    _stacks.clear()


def _stack_layers(base: nn.Module):
    """``base``'s decoder layers, or None where one of them, or one of its parts, is of a class not
    known here, has hooks or runs its own forward (not the fused one)."""
    layers = base.layers[: base.config.num_hidden_layers]
    for layer in layers:
        parts = (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
        if not _known(layer, DECODER_LAYERS) or _hooked(layer) or any(
                "forward" not in part.__dict__ or _hooked(part) for part in parts):
            return None
    return layers


def _run_stack(base: nn.Module, layers, layer_kernel, input_ids: torch.Tensor, position_ids: torch.Tensor,
               mask: torch.Tensor, cache, keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    assert mask.dtype == torch.bool and mask.dim() == 4, "the stack takes the engine's 4D bool mask"
    hidden = base.embed_tokens(input_ids)  # [B, T, H]
    position_embeddings = base.rotary_emb(hidden, position_ids=position_ids)
    if layer_kernel is not None:
        out = layer_kernel(base, layers, hidden, position_embeddings, mask, cache, keep)
        if out is not None:
            return out
    inputs = {}
    for i, layer in enumerate(layers):
        if i in keep:
            inputs[i] = hidden
        residual = hidden
        out, _ = layer.self_attn.forward(hidden_states=layer.input_layernorm.forward(hidden), attention_mask=mask,
                                         position_ids=position_ids, cache=cache, use_cache=True,
                                         position_embeddings=position_embeddings)
        hidden = residual + out
        residual = hidden
        hidden = residual + layer.mlp.forward(layer.post_attention_layernorm.forward(hidden))
    return base.norm.forward(hidden), inputs
