"""rollout.kernels.native_linear's AMX tiles (csrc/amx.cpp): bf16-valued weights on Intel's tile unit,
with each input row split exactly into three bf16 parts. What must hold: the split loses nothing
(a one-hot weight returns the input's bits), the outputs are within float32 rounding of the exact
sum and of the compact panels, each row's bits do not depend on the other rows, the row count or
the thread count, the pack refuses what it cannot hold, and an engine on a bf16-valued target
decodes consistently. Skipped where the tiles cannot run (no AMX-BF16 CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.engine.engine import Engine
from rollout.kernels import native_linear
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target
from tests.rollout.kernels.panels import pack_without

pytestmark = pytest.mark.skipif(not (native_linear.available() and native_linear.amx_available()),
                                reason="AMX tiles need an AMX-BF16 CPU (Intel Sapphire Rapids or later), the native "
                                       "library and HONEST_ROLLOUTS_AMX != 0")


def bf16_valued(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16().float()


def compact_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed as compact bf16 panels (the tiles off)."""
    return pack_without(weight, "amx")


def relative_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """max |y - exact| / (|x| |w|^T + |b|): the error of each output against the scale of its terms."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return ((y.double() - exact).abs() / scale.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64), (16, 32), (8192, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_outputs_are_within_float32_rounding_of_the_exact_sum(n, k, bias):
    """Every row count of the tile groups and their tails (1-33, 64, 257): float32 rounding of the
    sums only (the compact panels' own error is of the same size), and close to the compact panels."""
    w = bf16_valued(n, k, seed=n + k, scale=0.05)
    b = torch.randn(n) if bias else None
    tiles, panels = native_linear.pack(w), compact_pack(w)
    assert tiles.dtype == torch.int16 and panels.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(k)
    for m in [*range(1, 34), 64, 257]:
        x = torch.randn(m, k, generator=g)
        got = native_linear.linear(x, w, b, tiles)
        assert relative_error(got, x, w, b) < 1e-6, m
        torch.testing.assert_close(got, native_linear.linear(x, w, b, panels), rtol=1e-5, atol=1e-5)


def test_the_split_of_the_inputs_is_exact():
    """A one-hot weight (W = [I; 2 I]) returns each input value (and twice it) bit for bit: the
    three bf16 parts hold all of a float's 24 significant bits. Dropping the last part would
    miss the bits below about 2^-17 of each value."""
    k = 64
    w = torch.cat([torch.eye(k), 2 * torch.eye(k)])
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)) * torch.logspace(-20, 20, k)
    got = native_linear.linear(x, w, None, native_linear.pack(w))
    assert torch.equal(got[:, :k], x) and torch.equal(got[:, k:], 2 * x)


def test_extreme_inputs_and_weights():
    """Near the float range's ends: the split is exact down to 2^-103 and up to the largest float
    (the split truncates, so the top part cannot round up to inf); an inf input gives inf where its
    weight is not 0 and NaN where it is, as an fp32 sum does, and NaN stays in its own row; a
    subnormal bf16 weight (which the tile unit would read as zero) gets compact panels."""
    k = 64
    w = torch.cat([torch.eye(k), 2 * torch.eye(k)])
    tiles = native_linear.pack(w)
    x = torch.tensor([[3.4e38, -3.4028235e38, 1.2345678 * 2.0 ** -103, -1.2345678e-31, 1.0e-20, 2.0 ** -126]
                      + [1.5] * (k - 6)])
    got = native_linear.linear(x, w, None, tiles)
    assert torch.equal(got[:, :k], x) and torch.equal(got[:, k:], 2 * x)
    x = torch.ones(3, k)
    x[0, 3], x[1, 5] = math.inf, math.nan
    got = native_linear.linear(x, w, None, tiles)
    assert got[0, 3] == math.inf and got[0, k + 3] == math.inf
    assert got[0, :3].isnan().all() and got[0, 4:k].isnan().all()  # inf x 0
    assert got[1, :].isnan().all() and torch.equal(got[2], torch.cat([torch.ones(k), 2 * torch.ones(k)]))
    tiny = bf16_valued(32, 64, seed=8)
    tiny[5, 7] = 2.0 ** -130  # a bf16 subnormal: its low 16 bits are zero
    assert native_linear.pack(tiny).dtype == torch.bfloat16


def test_each_rows_bits_do_not_depend_on_the_batch_or_the_threads():
    """One row alone, in a batch of 37 at any place, and on one thread or two: the same bits."""
    n, k = 320, 1536
    w = bf16_valued(n, k, seed=5, scale=0.05)
    tiles = native_linear.pack(w)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2))
    batch = native_linear.linear(x, w, None, tiles)
    for i in (0, 15, 16, 31, 32, 36):
        assert torch.equal(native_linear.linear(x[i:i + 1], w, None, tiles)[0], batch[i]), i
        assert torch.equal(native_linear.linear(x[i:], w, None, tiles)[0], batch[i]), i
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(native_linear.linear(x, w, None, tiles), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n,k,dtype", [(40, 64, torch.bfloat16), (48, 48, torch.bfloat16), (8, 32, torch.bfloat16)])
def test_shapes_the_tiles_cannot_hold_get_compact_panels(n, k, dtype):
    """Output sizes must be multiples of 16 and the input size a multiple of 32."""
    w = bf16_valued(n, k, seed=3)
    packed = native_linear.pack(w)
    assert packed.dtype == dtype
    x = torch.randn(5, k)
    assert relative_error(native_linear.linear(x, w, None, packed), x, w, None) < 1e-6


def test_a_weight_with_one_value_that_is_not_bf16_gets_fp32_panels():
    w = bf16_valued(64, 64, seed=4)
    w[63, 63] += 1e-4  # its low 16 bits are not zero any more
    assert native_linear.pack(w).dtype == torch.float32
    parts = [bf16_valued(32, 64, seed=6), w]  # merged layers: tiles only when every part can be
    assert native_linear.pack_merged(parts).dtype == torch.float32
    assert native_linear.pack_merged([parts[0], bf16_valued(16, 64, seed=7)]).dtype == torch.int16


def test_the_switch_value_is_checked(monkeypatch):
    monkeypatch.setenv("HONEST_ROLLOUTS_AMX", "yes")
    with pytest.raises(ValueError, match="HONEST_ROLLOUTS_AMX must be one of auto, 0, 1; got 'yes'"):
        native_linear.amx_available.__wrapped__()
    monkeypatch.setenv("HONEST_ROLLOUTS_AMX", "0")
    assert native_linear.amx_available.__wrapped__() is False


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_engine_on_a_bf16_valued_target_decodes_on_the_tiles(mode):
    """A target and head whose weights are bf16 values (the rollout copy rounded to bf16): the
    engine packs them as tiles; greedy speculation emits plain greedy decoding's tokens, and
    sampled rows equal the compact panels' run where their logits agree to float32 rounding
    (the same tokens, log-probs within 1e-4)."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    with torch.no_grad():
        for p in [*target.parameters(), *head.parameters()]:
            p.copy_(p.bfloat16().float())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    spec = SpecConfig(mode=mode, num_draft_tokens=3) if mode == "chain" else SpecConfig(mode="tree")
    engine = Engine(target, head, num_threads=2, linear="native")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = engine.generate(prompts, sampling=greedy, spec=SpecConfig(mode="off"), seed=1)
    fast = engine.generate(prompts, sampling=greedy, spec=spec, seed=1)
    assert native_linear._buffers[target.model.lm_head.weight].dtype == torch.int16
    assert native_linear._merged_buffers[head.midlayer.self_attn].dtype == torch.int16
    assert fast.timings.draft_forwards > 0
    assert [c.completion_ids for c in fast.completions] == [c.completion_ids for c in plain.completions]
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30), spec=spec,
              verifier=VerifierConfig(name="overshoot", params={"lenience": 0.7}), seed=3)
    tiles = engine.generate(prompts, **kw)
    no_tiles = Engine(target, head, num_threads=2, linear="native", options=EngineOptions(amx=False))
    panels = no_tiles.generate(prompts, **kw)
    assert native_linear._buffers[target.model.lm_head.weight].dtype == torch.bfloat16
    for a, b in zip(tiles.completions, panels.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds
        torch.testing.assert_close(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs),
                                   rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(a.target_logprobs), torch.tensor(b.target_logprobs),
                                   rtol=0, atol=1e-4)
