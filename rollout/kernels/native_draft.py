"""The EAGLE-3 head's draft forwards in one C++ call each (``csrc/layer.cpp``: ``hr_draft_layer``).

A draft forward (``ModelRunner.draft_root``, the head over the pairs the target's round left;
``ModelRunner.draft_step``, over the tokens it just drafted) runs about 60 small ops besides its
linear layers: two norms and their concatenation, the rotary tables, q/k/v, the rotation, the
concatenation of the draft cache with the new keys and values, the attention, the residual adds,
the MLP, the final norm and the lm_head. On a 2-core Intel Xeon they cost about as much as the
layers' weights take to read at batch 1. Inside ``native_linear.routed`` (the head's weights
packed, its norms, attention and MLP on the fused forwards of :mod:`rollout.kernels.fused_layers`),
:func:`step` runs the same arithmetic in the same order from one call (the ``fc`` over target
features stays a kernel call of its own): the same bits as the head's forward (tests compare
them with ``torch.equal``).

One difference of layout: the new keys and values are written into the draft cache at the slots
right after the longest committed row (``slot0``; the Python forward concatenates them to the
cache instead, which puts them at the same places), slots past every row's committed length.
A speculative step leaves them there (the next ``draft_root`` overwrites them; a later Python step
of the same round reads them from the cache); ``draft_root`` moves them to each row's own slots,
as it does with the forward's.

A chain goes further (:func:`chain`, ``hr_draft_chain``): after the root, its k draws and k - 1
steps run from one call, the draws as ``rollout.engine.draft_sampling.sample_draft`` makes them
(sampled: ATen's softmax, the float64 running sum, the caller's uniforms; greedy, at T = 0 or
with ``draft_sampling: greedy``: the argmax as ``torch.argmax`` picks it) and the steps as
:func:`step` runs them, so the drafts and logits are the same bits as the loop's; the ~40 small
torch ops and the Python of each step (the mask, positions, embedding, the draw) go. Trees keep
the loop.

The engine's options (``rollout.options.EngineOptions``) come as arguments: ``native_draft``
off runs every step through the head's forward, ``draft_chains`` off a chain's steps one
:func:`step` each; both need ``fused`` and ``native_norm`` (the C++ layer is the fused forwards
with the native norms).

Where a call does not fit (no native library, those options off, the fused forwards not in place,
another head class, hooks, autograd, other dtypes, too many rows for the kernel, head sizes other
than 16/32/64/128, no room in the cache), :func:`step` returns None and the caller runs the head's
forward.
"""

from __future__ import annotations

import weakref

import torch

from rollout.eagle3_head import DraftLayer, Eagle3Head
from rollout.kernels import fused_layers, native_lib, native_linear
from rollout.options import EngineOptions

DEFAULTS = EngineOptions()

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> (native_linear.epoch, its arguments)


def _plan(head) -> tuple | None:
    """The head's constant arguments of ``hr_draft_layer`` (norm weights, packed panels, sizes), or
    None where the head does not fit (see the module docstring)."""
    cached = _plans.get(head)
    if cached is not None and cached[0] == native_linear.epoch:
        return cached[1]
    if type(head) is not Eagle3Head or type(head.midlayer) is not DraftLayer:  # (whose forwards are known)
        _plans[head] = (native_linear.epoch, None)
        return None
    layer = head.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)
    eps = [fused_layers._norm_eps(n) for n in norms]
    panels = [native_linear.panels_of(m) for m in (attn, attn.o_proj, mlp, mlp.down_proj, head.lm_head)]
    plan = None
    if (None not in eps and len(set(eps)) == 1 and not any(p is None for p in panels)
            and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms)
            and attn.d in (16, 32, 64, 128) and "forward" in attn.__dict__ and "forward" in mlp.__dict__
            and fused_layers.merged_groups(mlp) is not None
            and not any(fused_layers._hooked(m) for m in head.modules())):
        compact = native_linear.compact_bits(panels)
        plan = (norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[2].weight.data_ptr(), eps[0],
                *(p.data_ptr() for p in panels[:4]), compact, attn.nh, attn.nkv, attn.d, mlp.gate_proj.out_features,
                norms[3].weight.data_ptr(), panels[4].data_ptr(), head.lm_head.out_features,
                float(head.cfg.logit_scale), panels)
    _plans[head] = (native_linear.epoch, plan)
    return plan


def _fits_cache(plan: tuple, keys: torch.Tensor, values: torch.Tensor, b: int, length: int) -> bool:
    """Whether the draft cache's ``keys`` and ``values`` are contiguous float32 CPU buffers of one shape
    ``[b, the head's kv heads, >= length, head size]`` (the kernels write and read both with the
    keys' strides)."""
    return (keys.dtype == values.dtype == torch.float32 and keys.device.type == values.device.type == "cpu"
            and keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape and keys.dim() == 4
            and keys.shape[0] == b and (keys.shape[1], keys.shape[3]) == plan[10:12] and length <= keys.shape[2])


def step(head, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
         keys: torch.Tensor, values: torch.Tensor, slot0: int, logits: bool = True,
         options: EngineOptions = DEFAULTS) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """One draft forward: ``tokens [B, T]`` (target ids), ``hidden [B, T, H]`` (the head's output
    hidden states they follow) or ``[B, T, 3H]`` (target features: through the head's ``fc``
    first, as its forward does), ``positions [B, T]`` (RoPE positions), ``mask [B, T, L]`` bool
    over the draft cache's slots with ``L = slot0 + T``; ``keys``, ``values``: the draft cache's
    ``[B, Hkv, capacity, D]`` tensors, whose slots ``slot0 .. slot0 + T - 1`` take the forward's
    keys and values. Returns the draft logits ``[B, T, Vd]`` (float32, scaled as
    ``Eagle3Head.draft_logits``; None unless ``logits``) and output hidden states ``[B, T, H]``,
    or None where the forward does not fit (nothing was written then), or ``options`` (the
    engine's) keep the head's forward."""
    lib = native_lib._lib
    if not (options.native_draft and options.fused and options.native_norm and lib is not None):
        return None
    plan = _plan(head)
    if plan is None:
        return None
    b, t = tokens.shape
    length = slot0 + t
    h = head.cfg.hidden_size
    if not (hidden.shape[:2] == (b, t) and hidden.shape[2] in (h, 3 * head.cfg.target_hidden_size)
            and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
            and not torch.is_grad_enabled() and b * t <= native_linear.max_rows()
            and _fits_cache(plan, keys, values, b, length) and mask.shape == (b, t, length)
            and mask.dtype == torch.bool and mask.stride(-1) == 1
            and head.embed_tokens.weight.dtype == torch.float32):
        return None
    (w_in, w_hid, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, n_q, n_kv, d, inter, w_norm, p_lm, vocab,
     logit_scale, _) = plan
    emb = head.embed_tokens(tokens).contiguous()  # [B, T, H]
    hidden = (head.fc(hidden) if hidden.shape[2] != h else hidden).contiguous()
    cos, sin = (x.contiguous() for x in head.rotary.tables(positions))  # [B, T, d], as the forward's
    slots = (slot0 + torch.arange(t)).expand(b, t).contiguous()
    out = torch.empty(b, t, h, dtype=torch.float32)  # (float32 whatever the default dtype: the kernel writes floats)
    scores = torch.empty(b, t, vocab, dtype=torch.float32) if logits else None
    scratch = torch.empty(lib.hr_draft_layer_scratch(b * t, h, n_q, n_kv, d, inter), dtype=torch.float32)
    ks, ms = keys.stride(), mask.stride()
    status = lib.hr_draft_layer(emb.data_ptr(), hidden.data_ptr(), out.data_ptr(), b, t, h, w_in, w_hid, w_post, eps,
                                p_qkv, p_o, p_gu, p_down, compact, n_q, n_kv, d, inter, cos.data_ptr(),
                                sin.data_ptr(), keys.data_ptr(), values.data_ptr(), ks[0], ks[1], ks[2],
                                slots.data_ptr(), mask.data_ptr(), ms[0], ms[1], length, d ** -0.5, w_norm,
                                p_lm if logits else None, vocab, logit_scale,
                                scores.data_ptr() if logits else None, scratch.data_ptr())
    if status != 0:  # the conditions above are the kernels' own: cannot happen
        raise RuntimeError(f"hr_draft_layer refused the draft step (status {status})")
    return scores, out


def chain(head, logits: torch.Tensor, hidden: torch.Tensor, k: int, temperature: float, uniforms: torch.Tensor | None,
          draft_ids: torch.Tensor, committed: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
          values: torch.Tensor, slot0: int,
          options: EngineOptions = DEFAULTS) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A chain of ``k`` drafts after the root, from one C++ call (``hr_draft_chain``): the draws of
    ``rollout.engine.draft_sampling.sample_draft`` and the steps of :func:`step`, the same bits.

    ``logits [B, Vd]`` and ``hidden [B, H]``: the root's; ``uniforms [k, B]`` (float64): draft s
    of row b takes ``uniforms[s, b]``; ``uniforms`` None: a greedy chain (each draft the argmax of
    its logits, as ``torch.argmax``; ``temperature`` unread); ``draft_ids [Vd]``: each draft id's
    target id;
    ``committed [B, slot0]`` bool: the draft cache slots each row sees; ``positions [k - 1, B]``:
    the RoPE positions of steps 1 .. k - 1; ``keys``, ``values``: the draft cache, whose slots
    ``slot0 .. slot0 + k - 2`` take the steps' entries. Returns the draft ids ``[B, k]`` and the
    logits each was drawn from ``[B, k, Vd]``, or None where the chain does not fit or ``options``
    (the engine's: ``draft_chains`` off) keep the steps (then nothing was written and the caller
    runs the steps one by one)."""
    lib = native_lib._lib
    greedy = uniforms is None
    if not (options.native_draft and options.draft_chains and options.fused and options.native_norm
            and lib is not None and (greedy or temperature > 0)):
        return None
    plan = _plan(head)
    if plan is None:
        return None
    b, vocab = logits.shape
    h = head.cfg.hidden_size
    length = slot0 + k
    table = head.embed_tokens.weight
    if not (k >= 1 and hidden.shape == (b, h) and hidden.dtype == logits.dtype == torch.float32
            and (greedy or (uniforms.shape == (k, b) and uniforms.dtype == torch.float64))
            and draft_ids.shape == (vocab,) and draft_ids.dtype == torch.int64 and draft_ids.device.type == "cpu"
            and committed.shape == (b, slot0) and committed.dtype == torch.bool
            and positions.shape == (k - 1, b) and logits.device.type == hidden.device.type == "cpu"
            and not torch.is_grad_enabled() and b <= native_linear.max_rows()
            and _fits_cache(plan, keys, values, b, length)
            and table.dtype == torch.float32 and table.is_contiguous() and vocab == plan[15]):
        return None
    (w_in, w_hid, w_post, eps, p_qkv, p_o, p_gu, p_down, compact, n_q, n_kv, d, inter, w_norm, p_lm, _,
     logit_scale, _) = plan
    out = torch.empty(b, k, vocab, dtype=torch.float32)
    out[:, 0] = logits
    ids = torch.empty(b, k, dtype=torch.int64)
    hid = hidden.clone(memory_format=torch.contiguous_format)  # written in place by the call
    mask = torch.cat([committed, torch.ones(b, k, dtype=torch.bool)], 1).contiguous()  # [B, slot0 + k]
    cos, sin = (x.contiguous() for x in head.rotary.tables(positions))  # [k - 1, B, d]
    u = None if greedy else uniforms.contiguous()
    id_map = draft_ids.contiguous()  # (read as [Vd] contiguous)
    scratch = torch.empty(lib.hr_draft_chain_scratch(b, h, n_q, n_kv, d, inter, vocab), dtype=torch.float32)
    ks = keys.stride()
    status = lib.hr_draft_chain(table.data_ptr(), id_map.data_ptr(), hid.data_ptr(), out.data_ptr(),
                                ids.data_ptr(), None if greedy else u.data_ptr(),
                                0.0 if greedy else float(temperature), b, k, h, w_in, w_hid, w_post, eps,
                                p_qkv, p_o, p_gu, p_down, compact, n_q, n_kv, d, inter, cos.data_ptr(),
                                sin.data_ptr(), keys.data_ptr(), values.data_ptr(), ks[0], ks[1], ks[2],
                                mask.data_ptr(), mask.stride(0), slot0, d ** -0.5, w_norm, p_lm, vocab, logit_scale,
                                scratch.data_ptr())
    if status != 0:  # the conditions above are the kernels' own: cannot happen
        raise RuntimeError(f"hr_draft_chain refused the chain (status {status})")
    return ids, out
