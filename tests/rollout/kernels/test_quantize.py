"""rollout.kernels.quantize and the kernel's int8 panels: the head rounded to integers times a scale per
row, packed as a quarter of fp32's bytes, with the output bits of fp32 panels of the rounded
weight; the hf backend's ``drafter_weights: int8`` option. (The rollouts' law with an int8 head:
``test_engine_sampling.py``; whole generate calls against fp32 panels: ``test_native_linear_compact.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout.backend import WorkerSpec, build_backend
from rollout.config import ConfigError
from rollout.kernels import native_linear
from rollout.kernels.quantize import int8_rows, quantize_int8_
from rollout.models import TargetConfig
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.rollout.kernels.panels import assert_fp32_bits, fp32_pack

native = pytest.mark.skipif(not native_linear.available(),
                            reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


def rounded(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight rounded by int8_rows and registered (what quantize_int8_ does to a layer)."""
    values, scales = int8_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    native_linear.register_int8(values, scales)
    return values


# ------------------------------------------------------------------ the rounding itself


def test_each_row_is_integers_times_its_scale():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40)[:, None]
    values, scales = int8_rows(w)
    assert values.dtype == scales.dtype == torch.float32 and scales.shape == (40,)
    torch.testing.assert_close(scales, w.abs().amax(1) / 127)
    q = values / scales[:, None]
    assert torch.equal(q.round() * scales[:, None], values)  # exactly the float products
    q = q.round()
    assert q.abs().max() <= 127 and (q.abs().amax(1) == 127).all()  # each row's largest is +-127
    assert ((values - w).abs() <= scales[:, None] / 2 * (1 + 1e-5)).all()  # nearest integer
    assert torch.equal(int8_rows(values)[0], values)  # idempotent


def test_zero_rows_and_signed_zeros():
    w = torch.zeros(3, 8)
    w[1, 2], w[2] = 1.0, -1e-9
    w[1, 3] = -1e-4  # rounds to zero: +0, as the kernel's widened integer 0 times a scale
    values, scales = int8_rows(w)
    assert scales[0] == 0 and torch.equal(values[0], torch.zeros(8))
    assert values[1, 3].item() == 0 and not torch.signbit(values[1, 3])
    assert not torch.signbit(values).any() or (values[torch.signbit(values)] < 0).all()


def test_bad_weights_are_refused_naming_the_row():
    w = torch.randn(5, 4)
    w[3, 1] = float("nan")
    with pytest.raises(ValueError, match="row 3"):
        int8_rows(w)
    with pytest.raises(ValueError, match="2-D float32"):
        int8_rows(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(4,\)"):
        native_linear.register_int8(torch.randn(4, 4), torch.ones(3))


def test_quantize_rounds_every_linear_layer_and_keeps_biases():
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    before = [m.weight.detach().clone() for m in (net[0], net[2])]
    bias = net[0].bias.detach().clone()
    assert quantize_int8_(net) == 2
    for layer, w in zip((net[0], net[2]), before):
        values, scales = int8_rows(w)
        assert torch.equal(layer.weight, values)
        assert torch.equal(native_linear.int8_scales(layer.weight), scales)
    assert torch.equal(net[0].bias, bias)
    again = [m.weight.detach().clone() for m in (net[0], net[2])]
    quantize_int8_(net)
    assert all(torch.equal(m.weight, w) for m, w in zip((net[0], net[2]), again))


# ------------------------------------------------------------------ the kernel's int8 panels


@native
@pytest.mark.parametrize("n,k", [(8192, 576), (37, 17), (5, 3), (33, 1536), (192, 1152)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panels_give_the_bits_of_fp32_panels(n, k, bias):
    w = rounded(n, k, seed=n * k)
    b = torch.randn(n) if bias else None
    small, full = native_linear.pack(w), fp32_pack(w)
    assert small.dtype == torch.int8 and full.dtype == torch.float32
    panels = (n + 15) // 16
    assert small.numel() == panels * (16 * k + 64)  # a byte a value, 16 scales a panel
    assert_fp32_bits(w, b, small, full)


@native
@pytest.mark.parametrize("where", [(0, 0), (50, 20), (99, 39)])
def test_a_weight_changed_since_it_was_rounded_gets_fp32_panels(where):
    w = rounded(100, 40, seed=1)
    w[where] += 1e-3 * float(w.abs().max())
    panels = native_linear.pack(w)
    assert panels.dtype == torch.float32
    x = torch.randn(3, 40)
    assert torch.equal(native_linear.linear(x, w, None, panels), native_linear.linear(x, w, None, fp32_pack(w)))


@native
def test_a_value_beyond_127_steps_is_refused():
    w = rounded(16, 32, seed=2)
    scales = native_linear.int8_scales(w)
    native_linear.register_int8(w, scales / 2)  # every value is an integer multiple, up to 254
    assert native_linear.pack(w).dtype == torch.float32


@native
def test_merged_layers_are_int8_only_when_every_part_is():
    parts = [rounded(32, 48, seed=3), rounded(16, 48, seed=4)]
    merged = native_linear.pack_merged(parts)
    assert merged.dtype == torch.int8
    x = torch.randn(2, 48)
    full = native_linear.pack_merged(parts, options=EngineOptions(compact_panels=False))
    assert torch.equal(native_linear._run(x, None, None, merged, (48, 48)),
                       native_linear._run(x, None, None, full, (48, 48)))
    parts.append(torch.randn(16, 48))  # not registered
    assert native_linear.pack_merged(parts).dtype == torch.float32


@native
def test_routed_follows_the_weight_between_int8_and_fp32():
    """An optimizer step after the rounding: fp32 panels of the changed weight; rounded again: int8."""
    net = nn.Linear(64, 48, bias=False)
    x = torch.randn(2, 64)
    with torch.no_grad():
        quantize_int8_(net)
        for change, dtype in [(lambda: None, torch.int8), (lambda: net.weight.data.add_(1e-3), torch.float32),
                              (lambda: quantize_int8_(net), torch.int8)]:
            change()
            with native_linear.routed(net):
                got = net(x)
            assert native_linear._buffers[net.weight].dtype == dtype
            torch.testing.assert_close(got, F.linear(x, net.weight), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ the hf backend's option


def _spec(policy_dir, head_dir, **options) -> WorkerSpec:
    return WorkerSpec(TargetConfig(path=str(policy_dir)), str(head_dir), SamplingParams(),
                      SpecConfig(mode="chain", num_draft_tokens=3), VerifierConfig(), threads=2,
                      backend_options=options)


def test_an_unknown_drafter_weights_option_names_the_field_and_the_values(tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError, match=r"backend_options\.drafter_weights.*'int4'.*allowed: stored, int8"):
        build_backend(_spec(tiny_policy_dir, tiny_head_dir, drafter_weights="int4"))


def test_drafter_weights_int8_rounds_the_head_at_every_load(tiny_policy_dir, tiny_head_dir):
    stored = build_backend(_spec(tiny_policy_dir, tiny_head_dir))
    backend = build_backend(_spec(tiny_policy_dir, tiny_head_dir, drafter_weights="int8"))
    heads = [dict(h.named_parameters()) for h in (stored.head, backend.head)]
    linears = [name for name, m in backend.head.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) >= 5  # fc, q/k/v/o, the MLP, the lm_head
    for name in linears:
        w, original = heads[1][f"{name}.weight"], heads[0][f"{name}.weight"]
        assert native_linear.int8_scales(w) is not None and native_linear.int8_scales(original) is None
        assert torch.equal(w, int8_rows(original.detach())[0]) and not torch.equal(w, original)
    backend.load_drafter(str(tiny_head_dir))  # a reloaded head is rounded too
    assert native_linear.int8_scales(backend.head.lm_head.weight) is not None
    batch = backend.generate(PROMPTS := [[1, 20, 300], [5, 6]], sampling=SamplingParams(max_new_tokens=8),
                             spec=SpecConfig(mode="chain", num_draft_tokens=3), verifier=VerifierConfig(), seed=1)
    assert batch.completion_mask.shape[0] == len(PROMPTS)
    for i, n in enumerate(batch.completion_mask.sum(1).tolist()):  # lossless: P = p at every token
        assert torch.allclose(batch.behaviour_logprobs[i, :n], batch.target_logprobs[i, :n], atol=1e-5)


def test_trl_settings_take_drafter_weights_locally_and_refuse_a_bad_value():
    from trainers.trl.rollouts import RolloutSettings

    assert RolloutSettings(backend_options={"drafter_weights": "int8"}).backend_options == {"drafter_weights": "int8"}
    with pytest.raises(ConfigError, match=r"drafter_weights.*'fp4'.*allowed: stored, int8"):
        RolloutSettings(backend_options={"drafter_weights": "fp4"})


def test_rows_of_subnormal_magnitude_stay_within_127_steps():
    """A row whose largest value is subnormal has a scale rounded coarsely (max / 127 keeps few
    bits), so ``weight / scale`` can pass 127 (up to 190): the integers are still clamped to
    [-127, 127] and the values are exactly those integers times the scale."""
    w = torch.arange(1, 20001, dtype=torch.int32).view(torch.float32)[:, None] * torch.tensor([1.0, -0.5])
    values, scales = int8_rows(w)
    assert (scales > 0).any()
    q = values / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    assert torch.equal(q, q.round()) and q.abs().max() <= 127
    assert torch.equal(q * scales[:, None] + 0.0, values)
