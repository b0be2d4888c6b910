"""rollout.kernels.native_linear's compact panels: weights whose every value is a bfloat16 (an EAGLE-3
head stored in bf16) packed as bf16, and the same output bits as with fp32 panels (the engine
test covers int8 heads too; their panels: test_quantize.py). Where the CPU has AMX, bf16-valued
weights would be packed as AMX tiles instead (test_native_linear_amx.py): this module packs with
the tiles off (``EngineOptions(amx=False)``), so it tests the compact panels on every CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout.engine.engine import Engine
from rollout.kernels import native_linear
from rollout.kernels.quantize import quantize_int8_
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target
from tests.rollout.kernels.panels import assert_fp32_bits, fp32_pack

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


def bf16_valued(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


NO_AMX = EngineOptions(amx=False)  # bf16-valued weights as compact panels, not AMX tiles (this module's subject)


def pack(weight: torch.Tensor) -> torch.Tensor:
    return native_linear.pack(weight, options=NO_AMX)


@pytest.mark.parametrize("n,k", [(8192, 576), (37, 17), (5, 3), (33, 1536), (192, 1152)])
@pytest.mark.parametrize("bias", [False, True])
def test_compact_panels_give_the_bits_of_fp32_panels(n, k, bias):
    w = bf16_valued(n, k, seed=n * k)
    b = torch.randn(n) if bias else None
    compact, full = pack(w), fp32_pack(w)
    assert compact.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert compact.numel() == full.numel()  # the same layout, half the bytes
    assert torch.equal(compact.float(), full)
    assert_fp32_bits(w, b, compact, full)


@pytest.mark.parametrize("where", ["first row", "middle", "last value"])
def test_a_weight_with_one_value_that_is_not_bf16_gets_fp32_panels(where):
    w = bf16_valued(100, 40, seed=1)
    i, j = {"first row": (0, 7), "middle": (50, 20), "last value": (99, 39)}[where]
    w[i, j] += 1e-4 * abs(float(w[i, j])) + 1e-30
    assert not torch.equal(w.bfloat16().float(), w)
    panels = pack(w)
    assert panels.dtype == torch.float32
    x = torch.randn(3, 40)
    assert torch.equal(native_linear.linear(x, w, None, panels), native_linear.linear(x, w, None, fp32_pack(w)))


def test_merged_layers_are_compact_only_when_every_part_is():
    parts = [bf16_valued(32, 48, seed=2), bf16_valued(16, 48, seed=3)]
    assert native_linear.pack_merged(parts, options=NO_AMX).dtype == torch.bfloat16
    parts[1][3, 5] += 1e-3
    merged = native_linear.pack_merged(parts, options=NO_AMX)
    assert merged.dtype == torch.float32
    x = torch.randn(2, 48)
    expected = torch.cat([F.linear(x, p) for p in parts], -1)
    torch.testing.assert_close(native_linear._run(x, None, None, merged, (48, 48)), expected, rtol=1e-5, atol=1e-4)


def test_compact_off_packs_fp32():
    w = bf16_valued(16, 16, seed=4)
    assert pack(w).dtype == torch.bfloat16
    assert native_linear.pack(w, options=EngineOptions(compact_panels=False)).dtype == torch.float32


def test_routed_repacks_a_weight_that_stops_being_bf16_valued():
    """The packed copy follows the weight from block to block: compact while its values are
    bfloat16s, fp32 once one is not (e.g. after an optimizer step), compact again after."""
    net = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        net.weight.copy_(bf16_valued(48, 64, seed=5))
        x = torch.randn(2, 64)
        for change, dtype in [(lambda: None, torch.bfloat16), (lambda: net.weight.data.add_(1e-3), torch.float32),
                              (lambda: net.weight.data.copy_(net.weight.bfloat16().float()), torch.bfloat16)]:
            change()
            with native_linear.routed(net, options=NO_AMX):
                got = net(x)
            assert native_linear._buffers[net.weight].dtype == dtype
            torch.testing.assert_close(got, F.linear(x, net.weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_engine_with_a_compact_head_emits_the_same_bits_either_way(mode, weights):
    """A head whose weights are bf16 values (as the shipped one) or rounded to int8 weights
    (``drafter_weights: int8``, rollout.kernels.quantize): the engine packs it as bf16 / int8 panels and
    the fp32 target as fp32, and every token, kind and log-prob is the same as with fp32 panels."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    with torch.no_grad():
        if weights == "int8":
            quantize_int8_(head)
        else:
            for p in head.parameters():
                p.copy_(p.bfloat16().float())
    dtype = torch.int8 if weights == "int8" else torch.bfloat16
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    spec = SpecConfig(mode=mode, num_draft_tokens=3) if mode == "chain" else SpecConfig(mode="tree")
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30), spec=spec,
              verifier=VerifierConfig(name="overshoot", params={"lenience": 0.7}), seed=3)
    compact = Engine(target, head, num_threads=2, linear="native", options=NO_AMX).generate(prompts, **kw)
    assert native_linear._buffers[head.lm_head.weight].dtype == dtype
    assert native_linear._merged_buffers[head.midlayer.self_attn].dtype == dtype
    assert native_linear._buffers[target.model.lm_head.weight].dtype == torch.float32
    fp32 = EngineOptions(amx=False, compact_panels=False)
    full = Engine(target, head, num_threads=2, linear="native", options=fp32).generate(prompts, **kw)
    assert native_linear._buffers[head.lm_head.weight].dtype == torch.float32
    assert compact.timings.draft_forwards > 0
    for a, b in zip(compact.completions, full.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds
        assert a.behaviour_logprobs == b.behaviour_logprobs and a.target_logprobs == b.target_logprobs
