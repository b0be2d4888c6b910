"""The hf backend's ``weights: bfloat16`` option: the rollout copy's weights are rounded to the
nearest bf16 value at load and at every weight sync, the linear kernel then streams them as bf16
panels, and every behaviour log-prob is the rounded model's (the law the rollouts are drawn
from), not the policy's: the trainer's importance weights see the gap."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.backend import WorkerSpec, build_backend
from rollout.config import ConfigError
from rollout.kernels import native_linear
from rollout.models import TargetConfig, load_target, round_weights_
from rollout.params import SamplingParams, SpecConfig, VerifierConfig

PROMPTS = [[1, 20, 300], [5, 6], [7, 8, 9, 10, 11], [42]]


def _spec(policy_dir, head_dir, **options) -> WorkerSpec:
    return WorkerSpec(TargetConfig(path=str(policy_dir)), str(head_dir), SamplingParams(),
                      SpecConfig(mode="chain", num_draft_tokens=3), VerifierConfig(), threads=2,
                      backend_options=options)


def _eager_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion token | before) under ``model``'s plain HF forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each float32 value in magnitude (equal when it is one)."""
    low = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)
    high = torch.where(low == x, low, ((x.view(torch.int32) | 0xFFFF) + 1).view(torch.float32))
    return low, high


@pytest.mark.parametrize("to", ["bfloat16", "bfloat16_nearest"])
def test_round_weights_rounds_every_weight_matrix_once(tiny_policy_dir, to):
    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    model = target.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert round_weights_(model, "exact") == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    matrices = [n for n, p in model.named_parameters() if p.dim() >= 2]
    assert round_weights_(model, to, seed=5) == len(matrices) > 0
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        if p.dim() < 2:  # norm gains: nothing to stream, left exact
            assert torch.equal(p, before[n]), n
        elif to == "bfloat16_nearest":
            assert torch.equal(p, before[n].to(torch.bfloat16).float()), n
        else:  # stochastic: a bf16 neighbour of the weight, and not always the nearest
            low, high = _bf16_neighbours(before[n])
            assert torch.equal(p, p.to(torch.bfloat16).float()), n
            assert ((p == low) | (p == high)).all(), n
    # the tied output embedding is still the input embedding
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with pytest.raises(ConfigError, match="weights.*'fp8'.*allowed: exact, bfloat16, bfloat16_nearest"):
        round_weights_(model, "fp8")


def _rounded(x: torch.Tensor, to: str, seed: int) -> torch.Tensor:
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(x.clone())
    round_weights_(module, to, seed)
    return module.w.detach().double()


def test_stochastic_rounding_keeps_small_updates_that_nearest_rounding_loses():
    """An optimizer step moves a weight by far less than half a bf16 step. Nearest rounding then
    gives the old values back (the copy lags the policy); stochastic rounding is right on average,
    so a small update moving every weight the same way moves the copy's sum with it."""
    torch.manual_seed(0)
    w0 = (0.05 * torch.randn(256, 1024)).to(torch.bfloat16).float()  # bf16 values, as after a round
    delta = 2e-5 * torch.sign(torch.randn_like(w0))  # an Adam-like step, ~1/10 of a bf16 step here
    w1 = w0 + delta
    nearest = _rounded(w1, "bfloat16_nearest", 0)
    assert (nearest == w0.double()).float().mean() > 0.8  # most weights did not move
    stochastic = _rounded(w1, "bfloat16", 0)
    moved = ((stochastic - w0.double()) * delta.sign().double()).sum() / delta.abs().double().sum()
    assert 0.9 < float(moved) < 1.1  # the update survives on average
    moved_nearest = ((nearest - w0.double()) * delta.sign().double()).sum() / delta.abs().double().sum()
    assert float(moved_nearest) < 0.2 * float(moved)
    # seeded: the same copy from the same seed, another from another
    assert torch.equal(stochastic, _rounded(w1, "bfloat16", 0))
    assert not torch.equal(stochastic, _rounded(w1, "bfloat16", 1))
    # a weight halfway between neighbours goes either way about equally often
    half = _rounded(torch.full((64, 4096), 1.0 + 2 ** -8), "bfloat16", 3)
    assert set(half.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float(half.mean()) - (1.0 + 2 ** -8)) < 1e-4
    assert torch.equal(_rounded(-w1, "bfloat16", 0), -stochastic)  # the sign plays no part


def test_an_unknown_weights_option_names_the_field_and_the_values(tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError, match=r"backend_options\.weights.*'float16'.*allowed: exact, bfloat16, bfloat16_nearest"):
        build_backend(_spec(tiny_policy_dir, tiny_head_dir, weights="float16"))


@pytest.mark.parametrize("mode", ["off", "chain"])
def test_behaviour_logprobs_are_the_rounded_models(tiny_policy_dir, tiny_head_dir, mode):
    backend = build_backend(_spec(tiny_policy_dir, tiny_head_dir, weights="bfloat16"))
    exact, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    rounded = copy.deepcopy(exact.model)
    round_weights_(rounded, seed=0)  # the backend's first rounding: seed = version 0
    batch = backend.generate(PROMPTS, sampling=SamplingParams(temperature=1.0, max_new_tokens=12),
                             spec=SpecConfig(mode=mode, num_draft_tokens=3), verifier=VerifierConfig(), seed=3)
    to_rounded, to_exact = [], []
    for i, (prompt, completion) in enumerate(zip(batch.prompt_lists(), batch.completion_lists())):
        n = len(completion)
        behaviour = batch.behaviour_logprobs[i, :n].double()
        assert torch.allclose(behaviour, batch.target_logprobs[i, :n].double(), atol=1e-5)  # lossless: P = p
        to_rounded.append((behaviour - _eager_logprobs(rounded, prompt, completion)).abs().max())
        to_exact.append((behaviour - _eager_logprobs(exact.model, prompt, completion)).abs().max())
    assert max(to_rounded) < 2e-5  # the rounded model's, up to float32 rounding of our kernels
    assert max(to_exact) > 20 * max(to_rounded)  # not the policy's: the gap the correction sees


def test_set_weights_rounds_what_it_loads(tiny_policy_dir, tiny_head_dir):
    backend = build_backend(_spec(tiny_policy_dir, tiny_head_dir, weights="bfloat16"))
    exact = build_backend(_spec(tiny_policy_dir, tiny_head_dir))
    # a function of the values, so that the tied embedding's two keys hold the same new weight
    state = {k: v + 1e-3 * torch.sin(1e3 * v) for k, v in exact.target.model.state_dict().items()}
    assert backend.set_weights(state, 4) == 4 and exact.set_weights(state, 4) == 4
    expected = copy.deepcopy(exact.target.model)
    round_weights_(expected, "bfloat16", seed=4)  # seeded by the version: a replacement actor rounds alike
    for (name, p), q in zip(backend.target.model.named_parameters(), expected.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(backend.target.model.lm_head.weight, state["lm_head.weight"])
    for name, p in exact.target.model.named_parameters():
        assert torch.equal(p, state[name]), name


def test_rounded_weights_are_packed_as_bf16_panels(tiny_policy_dir, tiny_head_dir):
    """bf16 panels, or AMX tiles (dtype int16) where the CPU has them; the exact copy fp32 panels."""
    if not native_linear.available():
        pytest.skip("the native linear kernel is not built on this machine")
    backend = build_backend(_spec(tiny_policy_dir, tiny_head_dir, weights="bfloat16"))
    exact = build_backend(_spec(tiny_policy_dir, tiny_head_dir))
    name = "model.layers.0.mlp.down_proj.weight"
    rounded = torch.int16 if native_linear.amx_available() else torch.bfloat16
    assert native_linear.pack(dict(backend.target.model.named_parameters())[name]).dtype == rounded
    assert native_linear.pack(dict(exact.target.model.named_parameters())[name]).dtype == torch.float32
