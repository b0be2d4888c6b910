"""rollout.kernels.fused_layers: inside ``native_linear.routed`` the Llama-style norms, attention and MLPs
run leaner forwards: the same bits as the modules' own (with the linear kernel in both) except
attention, which runs ``csrc/attention.cpp`` (checked here against torch's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout.engine.engine import Engine
from rollout.kernels import fused_layers, native_layers, native_linear, native_ops
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target

needs_kernel = pytest.mark.skipif(not native_linear.available(),
                                  reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


UNFUSED = EngineOptions(fused=False)  # every module's own forward (the kernel still computes the linears)
TORCH_NORMS = EngineOptions(native_norm=False)  # the fused norms through torch's rms_norm


def _forward(target, ids):
    with torch.inference_mode():
        return target(ids, final=True)


@needs_kernel
def test_fused_forward_gives_the_same_bits():
    """Without a mask (attention through torch's causal path) and with torch's rms_norm, norms,
    merged q/k/v and gate/up and the rotary embedding give the same bits as the modules' own
    forwards."""
    target = tiny_target(seed=2)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    calls = []
    original = native_ops.rms_norm
    native_ops.rms_norm = lambda *a: calls.append(a[0].shape) or original(*a)
    try:
        with native_linear.routed(target, options=TORCH_NORMS):
            fused = _forward(target, ids)
            patched = [m for m in target.modules() if "forward" in m.__dict__]
    finally:
        native_ops.rms_norm = original
    assert patched and not calls  # fused, and no norm through the kernel
    with native_linear.routed(target, options=UNFUSED):
        plain = _forward(target, ids)
        assert not any("forward" in m.__dict__ and type(m).__name__ != "Linear" for m in target.modules())
    assert torch.equal(fused.logits, plain.logits)
    assert torch.equal(fused.features, plain.features) and torch.equal(fused.final, plain.final)


@needs_kernel
def test_native_norms_match_the_modules_own_up_to_rounding():
    """With the norm kernel (the default) the same forward differs only by float32 rounding."""
    target = tiny_target(seed=2)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    calls = []
    original = native_ops.rms_norm
    native_ops.rms_norm = lambda *a: calls.append(a[0].shape) or original(*a)
    try:
        with native_linear.routed(target):
            fused = _forward(target, ids)
    finally:
        native_ops.rms_norm = original
    assert len(calls) == 2 * 4 + 1  # every norm of the 4 layers and the final one
    with native_linear.routed(target, options=UNFUSED):
        plain = _forward(target, ids)
    torch.testing.assert_close(fused.logits, plain.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.final, plain.final, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 4, 576), (16, 1, 576), (3, 5, 577), (2, 9), (300, 256)])
def test_norm_kernel_against_torch_and_batch_invariant(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    got = native_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=2e-6, atol=1e-6)
    rows = x.reshape(-1, shape[-1])
    for i in range(0, rows.shape[0], 7):  # a row alone gives the bits it has in the batch
        assert torch.equal(native_ops.rms_norm(rows[i:i + 1], w, 1e-5), got.reshape(-1, shape[-1])[i:i + 1])
    assert native_ops.rms_norm(x.double(), w.double(), 1e-5) is None  # not fp32: the caller's torch path
    assert native_ops.rms_norm(x.requires_grad_(True), w, 1e-5) is None  # autograd


@needs_kernel
def test_modules_are_patched_inside_and_restored_after():
    target = tiny_target()
    head = copy_head(target)
    packed = []
    original = native_linear.pack
    native_linear.pack = lambda w, out=None: packed.append(tuple(w.shape)) or original(w, out)
    try:
        with native_linear.routed(target, head):
            patched = {type(m).__name__ for m in (*target.modules(), *head.modules()) if "forward" in m.__dict__}
            layer = target.model.model.layers[0]
            # q/k/v and gate/up run inside one merged call each: not routed, not packed on their own
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
                assert "forward" not in linear.__dict__
            assert "forward" in layer.self_attn.o_proj.__dict__ and "forward" in layer.mlp.down_proj.__dict__
            draft = head.midlayer.self_attn
            assert "forward" not in draft.k_proj.__dict__ and "forward" in draft.o_proj.__dict__
    finally:
        native_linear.pack = original
    assert patched == {"LlamaRMSNorm", "LlamaAttention", "LlamaMLP", "RMSNorm", "DraftAttention", "DraftMLP",
                       "Linear"}
    assert (32, 64) not in packed and (128, 64) not in packed  # k/v [32, 64], gate/up [128, 64]: merged only
    assert (32, 128) not in packed  # the head's k/v [32, 128] (its input is 2H wide): merged only too
    assert not any("forward" in m.__dict__ for m in (*target.modules(), *head.modules()))


@needs_kernel
def test_merged_weights_are_packed_afresh_in_every_block():
    """A weight changed through ``.data`` between blocks (as the TRL trainer's step does) reaches
    the merged q/k/v and gate/up calls."""
    target = tiny_target(seed=3)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    layer = target.model.model.layers[0]
    with native_linear.routed(target):
        before = _forward(target, ids).logits
    for lin in (layer.self_attn.k_proj, layer.mlp.up_proj):
        lin.weight.data.mul_(-1.5)
    with native_linear.routed(target):
        after = _forward(target, ids).logits
    with native_linear.routed():  # no routing: torch's GEMM and the modules' own forwards
        reference = _forward(target, ids).logits
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_autograd_falls_back_to_torch_and_keeps_gradients():
    target = tiny_target(seed=4)
    x = torch.randn(1, 3, 64, requires_grad=True)
    layer = target.model.model.layers[1]
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    expected = mlp(norm(x))
    with native_linear.routed(target):
        got = mlp(norm(x))
    assert torch.equal(got, expected)
    got.sum().backward()
    assert x.grad is not None and mlp.gate_proj.weight.grad is not None and norm.weight.grad is not None


def test_other_classes_keep_their_own_forward():
    class LlamaRMSNorm(nn.Module):  # a lookalike outside transformers: its formula is unknown
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

    assert fused_layers.norm_forward(LlamaRMSNorm()) is None
    target = tiny_target()
    attn = target.model.model.layers[0].self_attn
    assert fused_layers.merged_groups(attn) == [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.q_proj.bias = nn.Parameter(torch.zeros(64))  # biased projections (e.g. Qwen2) are not fused
    assert fused_layers.merged_groups(attn) is None


@needs_kernel
@pytest.mark.parametrize("mode", ["off", "chain", "tree"])
def test_engine_outputs_fused_or_not(mode):
    """The engine's forwards pass a mask, so attention runs the native kernel when fused: the
    same tokens, kinds and acceptance; log-probs equal to float32 rounding."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    spec = SpecConfig(mode=mode, num_draft_tokens=3) if mode != "tree" else SpecConfig(mode="tree")
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30), spec=spec,
              verifier=VerifierConfig(name="mars", params={"theta": 0.9}), seed=7)
    engine = Engine(target, head, num_threads=2, linear="native")
    calls = []
    original, layers = native_ops.attend, native_layers._run
    native_ops.attend = lambda *a: calls.append(a[0].shape) or original(*a)
    # (the target's stack runs each layer in one C++ call, attention kernel included)
    native_layers._run = lambda *a: calls.extend([a[2].shape] * len(a[1])) or layers(*a)
    try:
        fused = engine.generate(prompts, **kw)
    finally:
        native_ops.attend, native_layers._run = original, layers
    assert len(calls) >= 4 * 30 // 3  # every target forward's layers (4) went through the kernel
    calls.clear()
    native_ops.attend, native_layers._run = (lambda *a: calls.append(a[0].shape) or original(*a),
                                             lambda *a: calls.append(a[2].shape) or layers(*a))
    try:
        plain = Engine(target, head, num_threads=2, linear="native", options=UNFUSED).generate(prompts, **kw)
    finally:
        native_ops.attend, native_layers._run = original, layers
    assert not calls  # the modules' own forwards: neither the attention kernel nor the C++ layers
    for a, b in zip(fused.completions, plain.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds and a.step_emitted == b.step_emitted
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(a.target_logprobs), torch.tensor(b.target_logprobs),
                                   rtol=0, atol=1e-5)


def _masks(b: int, t: int, length: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """[B, 1, T, L] bool masks as the runner builds them: a causal block after each row's own
    committed length, a tree block (ancestors only), and a row with nothing committed."""
    keys = torch.arange(length)
    lengths = torch.randint(0, length - t + 1, (b,), generator=g)
    lengths[0] = length - t  # the longest row fills the keys
    causal = keys[None, None, :] <= (lengths[:, None] + torch.arange(t))[:, :, None]
    rel = keys[None, :] - lengths[:, None]
    tree = torch.rand(t, t, generator=g) < 0.5
    tree = (tree.tril(-1) | torch.eye(t, dtype=torch.bool))[None].expand(b, t, t)
    in_block = (rel >= 0) & (rel < t)
    seen = tree.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, length))
    tree_mask = (rel < 0)[:, None, :] | (seen & in_block[:, None, :])
    return {"causal": causal[:, None], "tree": tree_mask[:, None]}


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("b,t,length,hq,hkv", [(1, 1, 7, 9, 3), (5, 4, 40, 4, 2), (3, 9, 70, 6, 6), (2, 1, 200, 8, 1)])
def test_attention_kernel_matches_torch(d, b, t, length, hq, hkv):
    g = torch.Generator().manual_seed(d * b + length)
    cap = length + 11  # views into a longer cache, as the runner's
    kb, vb = torch.randn(b, hkv, cap, d, generator=g), torch.randn(b, hkv, cap, d, generator=g)
    k, v = kb[:, :, :length], vb[:, :, :length]
    q = (3 * torch.randn(b, t, hq, d, generator=g)).transpose(1, 2)  # [B, Hq, T, D], strided
    for name, mask in _masks(b, t, length, g).items():
        with torch.inference_mode():
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5,
                                                  enable_gqa=hq != hkv).transpose(1, 2)
            got = native_ops.attend(q, k, v, mask, d ** -0.5)
        assert got is not None and got.shape == (b, t, hq, d) and got.is_contiguous(), name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5, msg=name)


@needs_kernel
@pytest.mark.parametrize("case", ["nan q", "nan k", "nan k masked", "nan v", "inf score", "-inf scores", "inf v"])
def test_attention_kernel_shows_non_finite_inputs_as_torch_does(case):
    """A NaN in a query, in a key (one its query may see, or a masked one: torch's scores carry it
    too) or in a value, and an infinite score: NaN in the same outputs as torch's attention (the
    kernel's maximum and softmax once skipped NaN and clamped inf, giving finite outputs or zeros);
    scores all -inf give torch's zeros; the finite outputs to float32 rounding."""
    g = torch.Generator().manual_seed(8)
    b, t, length, hq, hkv, d = 3, 4, 20, 4, 2, 16
    q = torch.randn(b, hq, t, d, generator=g)
    k, v = torch.randn(b, hkv, length, d, generator=g), torch.randn(b, hkv, length, d, generator=g)
    mask = _masks(b, t, length, g)["causal"]
    seen = int(mask[0, 0, 1].nonzero()[-1])  # the last key query 1 of row 0 sees (query 0 does not)
    nan, inf = float("nan"), float("inf")
    if case == "nan q":
        q[1, 2, 0, 3] = nan
    elif case == "nan k":
        k[0, 1, seen, 5] = nan
    elif case == "nan k masked":
        k[0, 1, length - 1, 5] = nan  # past every query's keys in row 0 but the last one's
        mask[0, 0, -1, -1] = False
    elif case == "nan v":
        v[0, 1, seen, 5] = nan
    elif case == "inf score":
        q, k[2, 0, 0] = q.abs(), inf
    elif case == "-inf scores":
        q, k[2, 0] = q.abs(), -inf
    else:
        v[0, 1, seen] = inf
    with torch.inference_mode():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True).transpose(1, 2)
        got = native_ops.attend(q, k, v, mask, d ** -0.5)
    assert bool(ref.isnan().any()) == (case != "-inf scores")
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=2e-5)


@needs_kernel
def test_attention_kernel_is_batch_invariant():
    """A row's output does not depend on the other rows or on how far the keys are padded."""
    g = torch.Generator().manual_seed(5)
    b, t, length, d = 6, 3, 50, 64
    kb, vb = torch.randn(b, 3, 64, d, generator=g), torch.randn(b, 3, 64, d, generator=g)
    q = torch.randn(b, 9, t, d, generator=g)
    mask = _masks(b, t, length, g)["causal"]
    with torch.inference_mode():
        out = native_ops.attend(q, kb[:, :, :length], vb[:, :, :length], mask, 0.125)
        for row in range(b):
            own = int(mask[row, 0, -1].sum())  # the keys this row may see end here
            alone = native_ops.attend(q[row:row + 1], kb[row:row + 1, :, :own], vb[row:row + 1, :, :own],
                                         mask[row:row + 1, :, :, :own], 0.125)
            assert torch.equal(alone[0], out[row])


@needs_kernel
def test_attention_kernel_refuses_what_it_does_not_fit():
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 2, 10, 64)
    mask = torch.ones(1, 1, 2, 10, dtype=torch.bool)
    with torch.inference_mode():
        assert native_ops.attend(q, k, k, mask, 0.1) is not None
        assert native_ops.attend(q[..., :48], k[..., :48], k[..., :48], mask, 0.1) is None  # head dim 48
        assert native_ops.attend(q, k, k, mask.float(), 0.1) is None  # an additive mask
        longer = torch.randn(1, 2, 16, 64)[:, :, :10]  # values laid out unlike the keys
        assert native_ops.attend(q, k, longer, mask, 0.1) is None
        assert native_ops.attend(q.double(), k.double(), k.double(), mask, 0.1) is None
    assert native_ops.attend(q.requires_grad_(), k, k, mask, 0.1) is None  # autograd


@needs_kernel
def test_a_layer_with_hooks_is_not_merged_away():
    target = tiny_target()
    layer = target.model.model.layers[0]
    seen = []
    handle = layer.self_attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    try:
        with native_linear.routed(target):
            _forward(target, torch.tensor([[1, 2, 3]]))
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 3, 32])]


@needs_kernel
@pytest.mark.parametrize("past_len", [0, 9])
def test_draft_attention_fused_matches_its_own_forward(past_len):
    """The EAGLE-3 head's attention, fused (merged q/k/v, q and k rotated together, the native
    kernel over grouped kv heads when a past is given): its output equal to float32 rounding,
    its keys and values the same bits (both run the linear kernel; only the attention differs)."""
    target = tiny_target(seed=5)
    head = copy_head(target, noise=0.3)
    attn = head.midlayer.self_attn
    g = torch.Generator().manual_seed(past_len)
    b, t = 3, 4
    x = torch.randn(b, t, 2 * head.cfg.hidden_size, generator=g)
    pos = torch.arange(t)[None].expand(b, t) + past_len
    past = None
    if past_len:
        past = (torch.randn(b, attn.nkv, past_len, attn.d, generator=g),
                torch.randn(b, attn.nkv, past_len, attn.d, generator=g))
    mask = torch.rand(b, t, past_len + t, generator=g) < 0.6
    mask[:, :, past_len:] = torch.eye(t, dtype=torch.bool) | mask[:, :, past_len:].tril()  # each sees itself
    with torch.inference_mode():
        with native_linear.routed(head, options=UNFUSED):
            own, own_kv = attn(x, head.rotary, pos, mask, past)
        calls = []
        original = native_ops.attend
        native_ops.attend = lambda *a: calls.append(1) or original(*a)
        try:
            with native_linear.routed(head):
                fused, fused_kv = attn(x, head.rotary, pos, mask, past)
        finally:
            native_ops.attend = original
    assert calls == [1]
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_kv[0], own_kv[0]) and torch.equal(fused_kv[1], own_kv[1])


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_fused_attention_takes_the_cache_by_either_name(name):
    """transformers 5.25 hands a layer its KV cache as ``cache``, 5.19 (vLLM's pin) as
    ``past_key_values``: the fused attention must write and read it under both names, or a
    forward over a cached prefix silently attends to its own tokens only."""
    from transformers import DynamicCache

    target = tiny_target()
    attn = target.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 64, generator=g)
    cos_sin = target.model.model.rotary_emb(x, torch.arange(7).expand(2, -1))
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        whole, _ = attn(x, position_embeddings=cos_sin, attention_mask=causal)
        cache = DynamicCache()
        with native_linear.routed(target.model):
            attn(x[:, :4], position_embeddings=tuple(c[:, :4] for c in cos_sin), attention_mask=causal[..., :4, :4],
                 **{name: cache})
            tail, _ = attn(x[:, 4:], position_embeddings=tuple(c[:, 4:] for c in cos_sin),
                           attention_mask=causal[..., 4:, :], **{name: cache})
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(tail, whole[:, 4:], atol=1e-5, rtol=1e-5)
