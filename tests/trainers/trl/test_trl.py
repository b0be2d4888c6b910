"""The TRL plug-in with a real TRL GRPOTrainer on the tiny random policy (CPU): it trains
through our rollout_func, TRL's importance ratios are 1 for lossless rollouts and differ
from 1 (and change the loss) for lossy ones, the backend holds the trainer's weights
after an optimizer step (in-process and through the Ray pool), and settings TRL cannot
honour are refused before training starts."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rollout.config import ConfigError
from rollout.outputs import RolloutBatch
from rollout.params import SpecConfig, VerifierConfig
from tests.trainers.trl.trl_fixtures import PROMPTS, make_trainer
from trainers.grpo.correction import CorrectionConfig

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

def _valid_ratios(trainer) -> torch.Tensor:
    return torch.cat([trainer.importance_ratios(o)[o["completion_mask"].bool()] for o in trainer.outputs])


# ---------------------------------------------------------------------------- training
def test_trains_two_steps_lossless_on_policy(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "lossless")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["grad_norm"] > 0 for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), "weights did not change"
    ratios = _valid_ratios(trainer)  # step 2 ran on the weights step 1 changed: still on-policy
    assert ratios.numel() > 0 and (ratios - 1).abs().max() < 1e-3
    for h in logs:  # our metrics go through TRL's own logging
        assert abs(h["sampling/importance_sampling_ratio/max"] - 1) < 1e-3
        assert h["speculative/tau"] > 1.0  # the drafts were used
        assert h["speculative/relaxed_fraction"] == 0.0
        assert h["speculative/kl_k3"] < 1e-6 and h["speculative/is_ess"] > 0.999
    assert isinstance(trainer.rollouts.last_batch, RolloutBatch)


def test_trains_on_policy_with_sampled_trees(tmp_path, tiny_policy_dir, tiny_head_dir):
    """Trees of sampled candidates inside TRL: lossless, so the importance ratios stay 1."""
    spec = SpecConfig(mode="tree", depth=3, top_k=2, total_tokens=4, tree_candidates="sampled")
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "lossless", spec=spec)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    ratios = _valid_ratios(trainer)
    assert ratios.numel() > 0 and (ratios - 1).abs().max() < 1e-3
    assert all(h["speculative/tau"] > 1.0 for h in logs)


def test_lossy_ratios_differ_and_the_correction_changes_the_loss(tmp_path, tiny_policy_dir, tiny_head_dir):
    # on the random tiny model MARS almost never sees its runner-up drafted (q is spread over
    # 49k tokens), so its ratios stay ~1 here; the overshoot cap relaxes the p < q draws.
    # MARS at theta 0.9 on the real model: test_mars_on_the_embedded_model (slow).
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "overshoot", {"lenience": 0.3}, steps=1)
    inputs = [{"prompt": PROMPTS[i // 4]} for i in range(8)]
    out = trainer._generate_and_score_completions(inputs)
    batch = trainer.rollouts.last_batch
    mask = out["completion_mask"].bool()
    # what TRL divides by is our behaviour log-prob, token for token
    assert torch.allclose(out["sampling_per_token_logps"][mask], batch.behaviour_logprobs[batch.completion_mask])
    ratios = trainer.importance_ratios(out)[mask]
    assert (ratios - 1).abs().max() > 1e-2 and batch.relaxed.any()
    assert ratios.max() <= 2.0 + 1e-6  # token_tis: truncated at cap
    with torch.no_grad():
        on = trainer.compute_loss(trainer.model, out).item()
        trainer.use_vllm = False  # TRL's gate: the same batch without the correction
        off = trainer.compute_loss(trainer.model, out).item()
    assert math.isfinite(on) and math.isfinite(off) and abs(on - off) > 1e-6


@pytest.mark.parametrize("mode, trl_mode, clip", [
    ("token_tis", "token_truncate", (None, 2.0)), ("token_mis", "token_mask", (0.5, 2.0)),
    ("seq_tis", "sequence_truncate", (None, 2.0)), ("seq_mis", "sequence_mask", (0.5, 2.0)),
])
def test_correction_modes_map_onto_trl(mode, trl_mode, clip):
    from trainers.trl import trl_correction

    got = trl_correction(CorrectionConfig(mode=mode, cap=2.0, low=0.5, high=2.0))
    assert got == {"mode": trl_mode, "clip_min": clip[0], "clip_max": clip[1]}
    assert trl_correction(CorrectionConfig(mode="none")) is None


# ---------------------------------------------------------------------------- weights
def _assert_same_logits(backend_logits: torch.Tensor, model, prompts) -> None:
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]).float()
    assert torch.allclose(backend_logits, ref, atol=1e-5), (backend_logits - ref).abs().max()


def test_in_process_backend_holds_the_trained_weights(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1)
    prompts = [[1, 20, 300], [5, 6]]
    start = trainer.rollouts.backend.next_token_logits(prompts)
    trainer.train()
    after = trainer.rollouts.backend.next_token_logits(prompts)
    assert not torch.allclose(start, after, atol=1e-5)  # the step moved the logits ...
    _assert_same_logits(after, trainer.model, prompts)  # ... and the backend sees the new ones
    assert trainer.rollouts.backend.version == 0  # generated before the only optimizer step


def test_ray_pool_gets_the_weights_pushed(tmp_path, tiny_policy_dir, tiny_head_dir):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, placement="ray")
        trainer.train()
        pool = trainer.rollouts.pool
        assert pool.version == 1  # pushed before the second step's generation
        ratios = _valid_ratios(trainer)  # the actors' rollouts were on-policy at both steps
        assert (ratios - 1).abs().max() < 1e-3
        prompts = [[1, 20, 300], [5, 6]]
        trainer.rollouts.sync(trainer)  # push the weights of the last step too
        for logits in pool.next_token_logits(prompts):
            _assert_same_logits(logits, trainer.model, prompts)
        trainer.rollouts.close()
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- refusals
def test_geo_mis_is_refused_naming_the_setting(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, correction=CorrectionConfig(mode="geo_mis"))
    assert err.value.field == "correction.mode" and "token_tis" in str(err.value)


def test_use_vllm_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, use_vllm=True)
    assert "use_vllm" in str(err.value)


def test_sampling_trl_does_not_apply_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, top_p=0.9)
    assert err.value.field == "GRPOConfig.top_p"


def test_head_for_another_model_is_refused(tmp_path, tiny_policy_dir):
    from rollout.eagle3 import default_head_path

    with pytest.raises(Exception) as err:  # the SmolLM2 head: hidden size 576, the tiny policy's is 64
        make_trainer(tmp_path, tiny_policy_dir, default_head_path())
    assert "hidden" in str(err.value).lower() or "mismatch" in str(err.value).lower(), str(err.value)


def test_unknown_verifier_is_refused():
    with pytest.raises(ConfigError) as err:
        VerifierConfig("mystery")
    assert "mars" in str(err.value)


# ---------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_mars_on_the_embedded_model(tmp_path):
    """MARS at theta 0.9 with the embedded SmolLM2 and the shipped head: ratios differ from 1."""
    from rollout.eagle3 import default_head_path
    from rollout.models import embedded_cache_dir, load_embedded_target

    load_embedded_target()  # builds the safetensors cache the trainer loads from
    trainer = make_trainer(tmp_path, embedded_cache_dir(), default_head_path(), "mars", {"theta": 0.9}, steps=1,
                       max_completion_length=32)
    out = trainer._generate_and_score_completions([{"prompt": PROMPTS[i // 4]} for i in range(8)])
    ratios = trainer.importance_ratios(out)[out["completion_mask"].bool()]
    assert trainer.rollouts.last_batch.relaxed.any()
    assert (ratios - 1).abs().max() > 1e-2


def test_truncation_uses_the_cap_and_masking_the_bounds():
    """cap and high are different settings: a truncating mode clips at cap, a masking one keeps
    [low, high]."""
    from trainers.trl import trl_correction

    cfg = dict(cap=3.0, low=0.25, high=1.5)
    assert trl_correction(CorrectionConfig(mode="token_tis", **cfg)) == {
        "mode": "token_truncate", "clip_min": None, "clip_max": 3.0}
    assert trl_correction(CorrectionConfig(mode="seq_tis", **cfg))["clip_max"] == 3.0
    assert trl_correction(CorrectionConfig(mode="token_mis", **cfg)) == {
        "mode": "token_mask", "clip_min": 0.25, "clip_max": 1.5}
    assert trl_correction(CorrectionConfig(mode="seq_mis", **cfg))["clip_min"] == 0.25


def test_rollouts_sample_at_trls_temperature():
    """TRL recomputes log-probs at args.temperature; the rollouts must sample at the same one."""
    from types import SimpleNamespace

    from trainers.trl.rollouts import sampling_from_trl

    args = SimpleNamespace(top_p=1.0, top_k=None, min_p=None, repetition_penalty=1.0, temperature=0.7,
                           max_completion_length=16)
    s = sampling_from_trl(args, eos_token_id=2)
    assert (s.temperature, s.max_new_tokens, tuple(s.stop_token_ids)) == (0.7, 16, (2,))


def test_speculative_metrics_are_kl_of_behaviour_to_policy_and_ess_of_trls_ratios():
    """The logged drift on hand-built log-probs: k1 = mean(log P - log pi_old) and
    k3 = mean(r - 1 - log r) with r = pi_old / P over the valid tokens; ESS of TRL's ratios."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trainers.trl.trainer import SpeculativeGRPOTrainer

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    sampled = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    log_r = torch.tensor([[0.5, -0.2, 0.0], [1.0, -0.4, 9.0]])  # the 9.0 is padding
    old = sampled + log_r
    ratio = torch.tensor([[1.5, 0.8, 1.0], [2.0, 0.7, 5.0]])
    relaxed = torch.tensor([[True, False, False], [True, True, True]])
    batch = RolloutBatch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                         completion_ids=torch.ones(2, 3, dtype=torch.long), completion_mask=mask,
                         behaviour_logprobs=sampled, target_logprobs=sampled, kinds=torch.zeros(2, 3, dtype=torch.int8),
                         relaxed=relaxed, finish_reasons=["length"] * 2, tau=2.5, timings={"tokens": 5.0})
    trainer = SpeculativeGRPOTrainer.__new__(SpeculativeGRPOTrainer)  # only what the metrics read
    trainer.rollouts = SimpleNamespace(last_batch=batch, last_seconds=0.5, drafter_metrics={"drafter_est_tau": 2.5})
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(num_processes=1)  # one process: the values as they are
    trainer._log_rollout_metrics({"old_per_token_logps": old, "sampling_per_token_logps": sampled,
                                  "completion_mask": mask.long(), "importance_sampling_ratio": ratio})
    m = trainer._metrics["train"]
    lr = log_r[mask].double()
    assert m["speculative/kl_k1"] == [pytest.approx(float(-lr.mean()), abs=1e-6)]
    assert m["speculative/kl_k3"] == [pytest.approx(float((lr.exp() - 1 - lr).mean()), abs=1e-6)]
    w = ratio[mask].double()
    assert m["speculative/is_ess"] == [pytest.approx(float(w.sum() ** 2 / (5 * (w ** 2).sum())), abs=1e-6)]
    assert m["speculative/relaxed_fraction"] == [pytest.approx(3 / 5)]  # not the padded flag: 4 / 6
    assert m["speculative/tau"] == [2.5] and m["speculative/rollout_tokens_per_s"] == [pytest.approx(10.0)]
    # the head's training round is logged once, with the batch after it
    assert m["speculative/drafter_est_tau"] == [2.5] and trainer.rollouts.drafter_metrics == {}
