"""The training driver end to end on a tiny random policy with real Ray actors:
bad configs fail before Ray starts, lossless rollouts are on-policy (weights 1), a killed
actor loses no rollout, and resume reproduces the uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch

from rollout.config import ConfigError
from tests.trainers.conftest import write_config
from trainers.grpo.compare import DEFAULT_METRICS, comparison_markdown, load_run
from trainers.grpo.config import load_train_config


# ---------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize("section, values, field", [
    ("rollout", {"verifier": {"name": "mystery"}}, "rollout.verifier.name"),
    ("grpo", {"group_size": -2}, "grpo.group_size"),
    ("model", {"target": {"path": "/nowhere/model.gguf"}}, "model.target.path"),
    ("correction", {"mode": "sometimes"}, "correction.mode"),
    ("rollout", {"spec": {"mode": "forest"}}, "rollout.spec.mode"),
    ("optim", {"learning_rate": 1.0}, "optim.learning_rate"),
])
def test_bad_config_names_the_field(tmp_path, tiny_policy_dir, section, values, field):
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "out", **{section: values})
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert err.value.field == field, str(err.value)
    assert field in str(err.value)


def test_bad_config_lists_allowed_values(tmp_path, tiny_policy_dir):
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "out",
                        rollout={"verifier": {"name": "mystery"}})
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    for name in ("lossless", "mars", "overshoot"):
        assert name in str(err.value)


def test_bad_yaml_and_cli_exit_before_ray(tmp_path, capsys):
    import ray

    from scripts.train import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {steps: 2\n  oops: [")
    assert main(["--config", str(bad)]) == 2
    assert f"error: config file '{bad}': invalid YAML" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"error: config file '{tmp_path / 'missing.yaml'}': not found\n"
    assert not ray.is_initialized()


# ---------------------------------------------------------------------------- with Ray
def _trainer(tmp_path, policy, head, name, **sections):
    from trainers.grpo.loop import GRPOTrainer

    path = write_config(tmp_path / f"{name}.yaml", policy, head, tmp_path / name, **sections)
    return GRPOTrainer(load_train_config(path))


def test_lossless_rollouts_are_on_policy(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray):
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "onpolicy",
                       run={"steps": 2, "checkpoint_every": 0},
                       rollout={"verifier": {"name": "lossless", "params": {}}},
                       correction={"mode": "token_mis", "low": 0.999, "high": 1.001})
    rows = trainer.run()
    assert len(rows) == 2
    for r in rows:  # step 2 runs on weights updated by step 1: still on-policy
        assert r["log_ratio_abs_max"] < 1e-3, r
        assert r["is_masked_frac"] == 0.0
        assert r["relaxed_frac"] == 0.0
        assert r["rollout_vs_trainer_logp_max"] < 1e-3
    records = [json.loads(x) for x in (tmp_path / "onpolicy" / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 3
    for rec in records:
        w = torch.tensor(rec["weights"])
        assert torch.allclose(w, torch.ones_like(w), atol=1e-3)


def test_bf16_rounded_rollouts_are_corrected_towards_the_fp32_policy(tmp_path, tiny_policy_dir, tiny_head_dir,
                                                                     local_ray):
    # lossless verification, but the actor's copy is rounded to bf16 (rollout.backend_options):
    # the behaviour log-probs are the rounded model's, so the weights pi_old / P leave 1 by the
    # rounding's gap (a copy that were not rounded again after step 1's sync would be exact there)
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "bf16",
                       run={"steps": 2, "checkpoint_every": 0},
                       rollout={"verifier": {"name": "lossless", "params": {}}, "backend_options": {"weights": "bfloat16"}})
    rows = trainer.run()
    for r in rows:
        assert r["relaxed_frac"] == 0.0
        # exact weights: ~1e-6 (test_lossless_rollouts_are_on_policy); rounded: ~2e-3 on this policy
        assert 5e-4 < r["rollout_vs_trainer_logp_max"] < 0.05, r
        assert 5e-4 < r["log_ratio_abs_max"] < 0.05, r


def test_lossy_rollouts_are_off_policy_and_logged(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray):
    # on a random model p and q are near-uniform: MARS (rightly) rejects almost every draft
    # there, while the overshoot cap relaxes the p < q draws
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "lossy", run={"steps": 1},
                       rollout={"verifier": {"name": "overshoot", "params": {"lenience": 0.3}}})
    rows = trainer.run()
    assert rows[0]["relaxed_frac"] > 0
    assert rows[0]["log_ratio_abs_max"] > 1e-3
    out = tmp_path / "lossy"
    for name in ("metrics.jsonl", "rollouts.jsonl", "summary.md", "plots/reward.png", "plots/drift.png"):
        assert (out / name).is_file(), name
    assert list((out / "tb").iterdir())
    # every metric scripts/compare_runs shows by default is one the trainer logs
    assert "## mean reward" in comparison_markdown([load_run(out)], [k for k, _, _ in DEFAULT_METRICS], window=1)


def test_killed_actor_loses_no_rollout(tiny_policy_dir, tiny_head_dir, local_ray):
    from rollout.ray.actor import WorkerSpec
    from rollout.ray.actor_pool import RolloutPool
    from rollout.models import TargetConfig
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig

    spec = WorkerSpec(TargetConfig(path=str(tiny_policy_dir)), str(tiny_head_dir),
                      SamplingParams(max_new_tokens=48), SpecConfig(mode="chain", num_draft_tokens=3),
                      VerifierConfig("lossless"), threads=1)
    class KillAfterDispatch(RolloutPool):
        """Kills actor 0 right after its shard was submitted: the shard is lost mid-flight."""

        armed = False

        def _dispatched(self, shards):
            if self.armed:
                self.armed = False
                self.kill_actor(0)

    pool = KillAfterDispatch(spec, 2, num_cpus_per_actor=1, max_restarts=2)
    prompts = [[1 + i, 20 + i, 300 + i] for i in range(8)]
    ids = [f"r{i}" for i in range(8)]
    try:
        reference, _ = pool.generate(ids, prompts, seed=5)
        pool.armed = True
        batch, shards = pool.generate(ids, prompts, seed=5)
    finally:
        pool.shutdown()
    assert pool.stats.restarts == 1
    assert sorted(r for s in shards for r in s.request_ids) == sorted(ids)  # each exactly once
    # the lost shard was re-run with its own seed: identical to the run without a failure
    assert batch.completion_lists() == reference.completion_lists()
    assert torch.equal(batch.behaviour_logprobs, reference.behaviour_logprobs)


def _length_reward(text, answer, cfg=None) -> float:
    """A deterministic reward the random tiny policy earns unevenly (the real one is always 0
    there, which makes every advantage and gradient 0 and a resume that restores nothing pass)."""
    return float(len(text) % 3)


def test_resume_reproduces_the_next_step(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray, monkeypatch):
    monkeypatch.setattr("trainers.grpo.loop.answer_reward", _length_reward)
    full = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "full", run={"steps": 2})
    initial = {k: v.clone() for k, v in full.policy.state_dict().items()}
    rows_full = full.run()
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in rows_full), rows_full
    changed = [k for k, v in full.policy.state_dict().items() if not torch.equal(v, initial[k])]
    assert len(changed) > len(initial) // 2, changed
    part = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "part", run={"steps": 1})
    part.run()
    resumed = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "part", run={"steps": 2})
    rows_resumed = resumed.run()
    assert [r["step"] for r in rows_resumed] == [1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "kl_k3", "rollout_tokens"):
        assert rows_resumed[1][key] == pytest.approx(rows_full[1][key], rel=1e-6, abs=1e-9), key
    for (name, a), b in zip(full.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["default", "gpu", "grpo_drafter"])
def test_shipped_configs_validate(name):
    from pathlib import Path

    cfg = load_train_config(Path(__file__).parents[3] / "configs" / f"{name}.yaml")
    assert cfg.rollouts_per_step >= cfg.grpo.group_size
    assert cfg.drafter_training.enabled == (name == "grpo_drafter")


def test_overrides_merge_at_every_depth():
    from pathlib import Path

    path = Path(__file__).parents[3] / "configs" / "default.yaml"
    base = load_train_config(path)
    cfg = load_train_config(path, {"rollout": {"spec": {"max_batch": 4}}, "run": {"steps": 2}})
    assert cfg.rollout.spec.max_batch == 4 and cfg.run.steps == 2
    assert cfg.rollout.spec.num_draft_tokens == base.rollout.spec.num_draft_tokens  # untouched keys kept
    assert cfg.run.out_dir == base.run.out_dir and cfg.rollout.verifier == base.rollout.verifier
    # a rule's params belong to its name: replaced, not merged with the old rule's
    other = load_train_config(path, {"rollout": {"verifier": {"name": "overshoot", "params": {"lenience": 0.5}}}})
    assert other.rollout.verifier.params == {"lenience": 0.5}
    with pytest.raises(ConfigError, match="'rollout.spec.max_batch'"):
        load_train_config(path, {"rollout": {"spec": {"max_batch": 0}}})
