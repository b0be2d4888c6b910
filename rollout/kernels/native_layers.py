"""The target's decoder layers in one C++ call each (``csrc/layer.cpp``: ``hr_decoder_layer``).

Inside the stack loop of ``rollout.kernels.fused_layers.stack_forward`` (which ``TargetModel.body``
hands :func:`run` as its ``layer_kernel``), with the engine's cache (``RowKVCache``), the native
norms and the attention kernel's conditions, a layer's norm, q/k/v, rotation, cache write,
attention, o projection, residual, norm, gate/up, SiLU (ATen's kernel), product, down projection
and residual run from one call, the same arithmetic in the same order as the fused Python
forwards: the same bits (tests compare them with ``torch.equal``), without ~40 op dispatches per
layer. On an Intel Xeon (2 cores) a batch-1 SmolLM2-135M forward went from 36.5 to 26.0 ms, a
4-token block from 40.8 to 29.6, batch 16 from 64.3 to 46.3 ms (one process, interleaved).

Where a forward does not fit (``EngineOptions(native_layers=False)``, no native library or native
norms (``native_norm`` off), another cache
(or one not float32, or prepared for other rows or tokens), a mask not ``[B or 1, 1, T or 1, L]``,
another attention implementation or layer class, a sliding window, head sizes other than
16/32/64/128, weights not packed by the current ``native_linear.routed`` block, too many rows),
:func:`run` returns None and the loop runs the layers from Python.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from rollout.kernels import fused_layers, native_lib, native_linear
from rollout.options import EngineOptions

DEFAULTS = EngineOptions()
_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base -> (native_linear.epoch, layer arguments)


def run(base: nn.Module, layers, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor, cache,
        keep: tuple[int, ...],
        options: EngineOptions = DEFAULTS) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """``fused_layers.stack_forward``'s layer kernel: the final norm's output and the kept layer
    inputs, as the loop returns them, or None where the layers do not fit (module docstring).
    options: the engine's (``rollout.options.EngineOptions``): ``native_layers`` off: None
    (the loop runs the layers from Python); ``layer_stack`` off: one C++ call per layer."""
    plan = _plan(base, layers, cache, mask, hidden, options) if options.native_layers else None
    if plan is None:
        return None
    return _run(base, plan, hidden, position_embeddings, mask, cache, keep, options)


def _plan(base: nn.Module, layers, cache, mask: torch.Tensor, hidden: torch.Tensor,
          options: EngineOptions = DEFAULTS) -> list[tuple] | None:
    """Per layer, the constant arguments of ``hr_decoder_layer`` (norm weights, packed panels, sizes),
    or None where a forward does not fit it: it needs the engine's cache (float32, prepared for
    this forward's rows and tokens), the attention kernel's conditions (plain softmax attention,
    no sliding window, head size 16-128, a bool mask ``[B or 1, 1, T or 1, L]`` over the cache's
    visible slots), the native norms and every layer's weights packed by this ``routed`` block."""
    lib = native_lib._lib
    config = base.config
    b, t = hidden.shape[:2]
    if not (lib is not None and options.native_norm and getattr(cache, "native_rows", False)
            and cache._index is not None
            and config._attn_implementation in fused_layers.PLAIN_ATTENTION
            and getattr(config, "sliding_window", None) is None
            and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and 0 < b * t <= native_linear.max_rows()
            and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1
            and mask.shape[2] in (1, t) and mask.shape[3] == cache._kv_len and mask.stride(-1) == 1):
        return None
    cached = _plans.get(base)
    if cached is not None and cached[0] == native_linear.epoch:
        return cached[1] if _fits_cache(cached[1], cache, b, t) else None
    plan = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        eps = [fused_layers._norm_eps(n) for n in norms]
        panels = [native_linear.panels_of(m) for m in (attn, attn.o_proj, mlp, mlp.down_proj)]
        d = attn.head_dim
        if (None in eps or eps[0] != eps[1] or any(p is None for p in panels)
                or any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms)
                or d not in (16, 32, 64, 128) or not fused_layers._known(attn, fused_layers.ATTENTIONS)
                or fused_layers.merged_groups(mlp) is None):
            return None
        compact = native_linear.compact_bits(panels)
        n_q, n_kv = attn.q_proj.out_features // d, attn.k_proj.out_features // d
        plan.append((attn.layer_idx, norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), eps[0],
                     *(p.data_ptr() for p in panels), compact, n_q, n_kv, d, mlp.gate_proj.out_features,
                     float(attn.scaling), panels))
    if len({p[10:12] for p in plan}) != 1:  # one cache shape holds every layer's keys and values
        return None
    _plans[base] = (native_linear.epoch, plan)
    return plan if _fits_cache(plan, cache, b, t) else None


def _fits_cache(plan: list[tuple], cache, b: int, t: int) -> bool:
    """Whether the kernels may write ``cache`` as float32 ``[rows, kv heads, slots, head size]`` buffers
    (keys and values alike, their strides the keys') at the slots ``prepare`` set for ``b`` rows
    of ``t`` tokens. The first planned layer's buffers stand for every layer's (a ``RowKVCache``
    allocates and slices them alike). Anything else runs the Python layers, which raise where
    torch does (a bf16 cache, say), not write past the buffers."""
    k, v = cache.keys[plan[0][0]], cache.values[plan[0][0]]
    rows, index = cache._rows, cache._index
    return (k.dtype == v.dtype == torch.float32 and k.device.type == v.device.type == "cpu"
            and k.shape == v.shape and k.stride() == v.stride() and k.stride(-1) == 1
            and (k.shape[1], k.shape[3]) == plan[0][10:12] and cache._kv_len <= k.shape[2]
            and rows.step in (None, 1) and (rows.start or 0) + b <= k.shape[0]
            and index.dtype == torch.int64 and index.shape[0] == b and index.shape[2] == t)


def _run(base: nn.Module, plan, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor, cache,
         keep: tuple[int, ...], options: EngineOptions = DEFAULTS) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The layers over ``hidden`` (updated in place: the inputs kept for the features are copies),
    then the final norm: all of them in one ``hr_decoder_stack`` call where ``options.layer_stack``
    is on and they share their sizes, else each in one ``hr_decoder_layer`` call."""
    lib = native_lib._lib
    b, t, h = hidden.shape
    hidden = hidden.contiguous()
    rows, length = cache._rows, cache._kv_len
    mask = mask.expand(b, 1, t, length)  # a broadcast batch or query dimension: stride 0, as the kernels read it
    cos, sin = (x.to(torch.float32).expand(b, t, -1).contiguous() for x in position_embeddings)
    slots = cache._index[:, 0, :, 0].contiguous()  # [B, T]: each token's cache slot
    first = plan[0]
    scratch = torch.empty(lib.hr_decoder_layer_scratch(b * t, h, first[9], first[10], first[11], first[12]),
                          dtype=torch.float32)  # float32 whatever the default dtype (the kernels write floats)
    ms = mask.stride()
    if options.layer_stack and len({(p[3], *p[9:14]) for p in plan}) == 1:  # the layers share eps, sizes and scale
        kept = sorted({i for i in keep if i < len(plan)})
        where = {i: j for j, i in enumerate(kept)}
        k0 = cache.keys[first[0]]
        skip = (rows.start or 0) * k0.stride(0) * k0.element_size()  # bytes to this forward's first row
        # a row per layer: w_in, w_post, the four panels, compact, its key and value cache, keep
        table = torch.tensor([(*p[1:3], *p[4:9], cache.keys[p[0]].data_ptr() + skip,
                               cache.values[p[0]].data_ptr() + skip, where.get(i, -1)) for i, p in enumerate(plan)],
                             dtype=torch.int64)
        out = torch.empty(len(kept), b, t, h, dtype=torch.float32)
        ks = cache.keys[first[0]].stride()
        status = lib.hr_decoder_stack(hidden.data_ptr(), b, t, h, len(plan), table.data_ptr(), first[3], first[9],
                                      first[10], first[11], first[12], cos.data_ptr(), sin.data_ptr(), ks[0], ks[1],
                                      ks[2], slots.data_ptr(), mask.data_ptr(), ms[0], ms[2], length, first[13],
                                      out.data_ptr(), scratch.data_ptr())
        if status != 0:  # the conditions of ``_plan`` are the kernels' own: cannot happen
            raise RuntimeError(f"hr_decoder_stack refused a layer (status {status})")
        return base.norm.forward(hidden), {i: out[j] for j, i in enumerate(kept)}
    inputs = {}
    for i, (idx, w_in, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, n_q, n_kv, d, inter, scale, _) in enumerate(plan):
        if i in keep:
            inputs[i] = hidden.clone()
        k_buf, v_buf = cache.keys[idx][rows], cache.values[idx][rows]
        ks = k_buf.stride()
        status = lib.hr_decoder_layer(hidden.data_ptr(), b, t, h, w_in, w_post, eps, p_qkv, p_o, p_gu, p_down, compact,
                                      n_q, n_kv, d, inter, cos.data_ptr(), sin.data_ptr(), k_buf.data_ptr(),
                                      v_buf.data_ptr(), ks[0], ks[1], ks[2], slots.data_ptr(), mask.data_ptr(), ms[0],
                                      ms[2], length, scale, scratch.data_ptr())
        if status != 0:  # the conditions above are the kernels' own: cannot happen
            raise RuntimeError(f"hr_decoder_layer refused layer {idx} (status {status})")
    return base.norm.forward(hidden), inputs
