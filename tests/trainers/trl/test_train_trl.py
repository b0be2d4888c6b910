"""scripts/train_trl.py: a bad config is refused before any model loads (rc 2, the dotted
field named, the run folder untouched), a one-step run on the tiny policy leaves metrics,
summary and plots and first moves an earlier run's aside, and placement ray generates in the
Ray pool with model.target."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("trl")


def _config(path, policy, head, out, **sections):
    cfg = {
        "run": {"out_dir": str(out), "steps": 1, "seed": 0},
        "model": {"target": {"path": str(policy)}, "drafter": str(head)},
        "rollout": {"spec": {"mode": "chain", "num_draft_tokens": 3},
                    "verifier": {"name": "overshoot", "params": {"lenience": 0.3}}, "threads": 2},
        "task": {"source": "arithmetic", "difficulty": 1, "prompts_per_step": 2},
        "correction": {"mode": "token_tis", "cap": 2.0},
        "trl": {"num_generations": 4, "max_completion_length": 8, "temperature": 1.0, "learning_rate": 1e-3,
                "logging_steps": 1, "save_strategy": "no", "report_to": []},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_float16_policy_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir, capsys, monkeypatch):
    from scripts.train_trl import main

    monkeypatch.setattr("rollout.models.load_target", _no_model)
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                   model={"target": {"path": str(tiny_policy_dir), "dtype": "float16"}})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "config field 'model.target.dtype'" in err and "(allowed: float32, bfloat16)" in err


@pytest.mark.parametrize("dtype, trl_args", [("float32", {"bf16": True}), ("bfloat16", {})])
def test_bf16_trains_one_step(tmp_path, tiny_policy_dir, tiny_head_dir, dtype, trl_args):
    """Mixed precision over fp32 weights (trl.bf16) and a bf16 policy (warned about: no fp32 master
    copy) both train, with the lossless verifier, to a finite loss."""
    import math

    import torch

    from trainers.trl.config import load_trl_config
    from trainers.trl.run import run

    out = tmp_path / "out"
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out,
                   model={"target": {"path": str(tiny_policy_dir), "dtype": dtype}},
                   rollout={"verifier": {"name": "lossless", "params": {}}}, trl=trl_args)
    if dtype == "bfloat16":
        with pytest.warns(UserWarning, match="no fp32 master copy"):
            cfg = load_trl_config(path)
    else:
        cfg = load_trl_config(path)
    assert cfg.grpo_config().bf16
    kept = []

    class Kept:
        def train(self, *args, **kwargs):
            kept.append(self)
            return super().train(*args, **kwargs)

    rows = run(cfg, mixins=(Kept,))
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"])
    (trainer,) = kept
    assert trainer.args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    expected = torch.bfloat16 if dtype == "bfloat16" else torch.float32  # the weights the optimizer steps
    assert {p.dtype for p in trainer.model.parameters()} == {expected}
    assert abs(rows[0]["is_weight_mean"] - 1) < 0.1  # the rollouts sampled the policy TRL scored


@pytest.mark.parametrize("section, values, field", [
    ("rollout", {"verifier": {"name": "mystery"}}, "rollout.verifier.name"),
    ("rollout", {"placement": "cloud"}, "rollout.placement"),
    ("rollout", {"drafter": "x"}, "rollout.drafter"),
    ("correction", {"mode": "geo_mis"}, "correction.mode"),
    ("trl", {"top_k": 50}, "trl.top_k"),
    ("trl", {"output_dir": "x"}, "trl.output_dir"),
    ("trl", {"num_generation": 4}, "trl.num_generation"),
    ("run", {"generation": "vllm"}, "run.generation"),
    # TRL's own checks and the kinds of the trl arguments, run when the config loads
    ("trl", {"num_generations": 1}, "trl.num_generations"),
    ("trl", {"learning_rate": "abc"}, "trl.learning_rate"),
    ("trl", {"max_completion_length": 3.5}, "trl.max_completion_length"),
    ("trl", {"max_completion_length": 0}, "trl.max_completion_length"),
    ("trl", {"generation_batch_size": 10}, "trl.generation_batch_size"),
    ("trl", {"lr_scheduler_type": "sometimes"}, "trl.lr_scheduler_type"),
    # settings the script would silently override
    ("trl", {"vllm_importance_sampling_correction": False}, "trl.vllm_importance_sampling_correction"),
    ("trl", {"vllm_importance_sampling_cap": 3.0}, "trl.vllm_importance_sampling_cap"),
    ("rollout", {"seed": 3}, "rollout.seed"),
    ("rollout", {"threads": 0}, "rollout.threads"),
    ("rollout", {"backend": "vllm", "backend_options": {"kv_cach": 1}}, "rollout.backend_options"),
])
def test_bad_config_exits_2_naming_the_field(tmp_path, tiny_policy_dir, tiny_head_dir, capsys, monkeypatch, section,
                                             values, field):
    from scripts.train_trl import main

    monkeypatch.setattr("rollout.models.load_target", _no_model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out, **{section: values})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config field '{field}'" in err and "Traceback" not in err
    # refused before anything ran: the earlier run's outputs neither moved nor emptied
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("name, value", [("use_cpu", False), ("seed", 1)])
def test_grpo_arguments_the_script_sets_are_refused_as_such(tmp_path, tiny_policy_dir, tiny_head_dir, name, value):
    from rollout.config import ConfigError
    from trainers.trl.config import load_trl_config

    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out", trl={name: value})
    with pytest.raises(ConfigError, match=f"'trl.{name}': is set by the script from the other sections"):
        load_trl_config(path)


def _no_model(*args, **kwargs):
    raise AssertionError("a model loaded before the config was refused")


def test_a_bad_task_file_exits_2_before_any_model_loads(tmp_path, tiny_policy_dir, tiny_head_dir, capsys,
                                                       monkeypatch):
    from scripts.train_trl import main

    monkeypatch.setattr("rollout.models.load_target", _no_model)
    bad = tmp_path / "task.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\nnot json\n')
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                   task={"source": "jsonl", "path": str(bad)})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "config field 'task.path'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_sampling_errors_name_the_grpo_config_argument():
    """The library's check (SpeculativeGRPOTrainer) names GRPOConfig's argument, not ours."""
    from types import SimpleNamespace

    from rollout.config import ConfigError
    from trainers.trl.rollouts import sampling_from_trl

    base = dict(top_p=1.0, top_k=None, min_p=None, repetition_penalty=1.0, temperature=1.0, max_completion_length=8)
    for change, field in [({"temperature": float("inf")}, "GRPOConfig.temperature"),
                          ({"max_completion_length": 0}, "GRPOConfig.max_completion_length"),
                          ({"max_completion_length": 3.5}, "GRPOConfig.max_completion_length")]:
        with pytest.raises(ConfigError, match=f"config field '{field}'"):
            sampling_from_trl(SimpleNamespace(**{**base, **change}), None)
    assert sampling_from_trl(SimpleNamespace(**base), 2).max_new_tokens == 8


@pytest.mark.parametrize("argv", [[], ["--generation", "trl"]])
def test_head_training_with_trls_own_generation_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir, capsys, argv):
    """TRL's own generation drafts with no head: training one there would silently do nothing."""
    from scripts.train_trl import main

    run = {"generation": "ours" if argv else "trl"}
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out", run=run,
                   rollout={"drafter_training": {"every": 1}})
    assert main(["--config", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert "config field 'rollout.drafter_training.every'" in err and "(allowed: 0)" in err
    assert not (tmp_path / "out").exists()


def test_one_step_leaves_the_run_outputs_and_moves_an_earlier_runs_aside(tmp_path, tiny_policy_dir,
                                                                          tiny_head_dir, capsys):
    from scripts.train_trl import main

    out = tmp_path / "out"
    earlier = {"metrics.jsonl": '{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.7}\n',
               "summary.md": "the earlier run's table\n", "plots/reward.png": "png",
               "tb/events.out.tfevents.1": "tb", "checkpoint-2/trainer_state.json": "{}"}
    for name, text in earlier.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out)
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 1
    for key in ("reward_mean", "tau", "relaxed_frac", "kl_k3", "is_ess", "rollout_tokens_per_s", "loss"):
        assert key in rows[0], key
    assert rows[0]["relaxed_frac"] > 0 and rows[0]["kl_k3"] > 0  # overshoot relaxes on the tiny model
    for name in ("summary.md", "plots/reward.png", "plots/tau.png", "plots/drift.png"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert "step 1/1" in printed
    # the earlier run's outputs, whole, under superseded/<time>/ (and said where)
    (fenced,) = (out / "superseded").iterdir()
    for name, text in earlier.items():
        assert (fenced / name).read_text() == text, name
    assert not (out / "checkpoint-2").exists() and f"to {fenced}" in printed


def test_placement_ray_takes_the_target_from_model_target(tmp_path, tiny_policy_dir, tiny_head_dir):
    from rollout.models import TargetConfig
    from trainers.trl.config import load_trl_config

    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                   rollout={"placement": "ray", "num_actors": 1, "threads_per_actor": 1})
    cfg = load_trl_config(path)
    assert cfg.rollout.placement == "ray"
    assert cfg.settings().target == cfg.model.target == TargetConfig(path=str(tiny_policy_dir))


def test_shipped_trl_config_validates():
    from trainers.trl.config import load_trl_config

    cfg = load_trl_config("configs/trl.yaml")
    assert cfg.rollout.verifier.name == "mars" and cfg.correction.mode == "token_tis"
    assert cfg.settings().drafter is not None and cfg.rollout.spec.mode == "chain"


def test_the_heads_training_rounds_reach_the_metrics_and_the_summary(tmp_path, tiny_policy_dir, tiny_head_dir,
                                                                      monkeypatch):
    """Row s holds the round after step s, as make run writes it: TRL logs it with the next step,
    and the last step's (trained at the final checkpoint) only in its final log, which has no loss."""
    from scripts.train_trl import main
    from trainers.grpo.online_drafter import OnlineDrafter

    rounds = {}
    original = OnlineDrafter.train_on_batch
    monkeypatch.setattr(OnlineDrafter, "train_on_batch",
                        lambda self, step, batch: rounds.setdefault(step + 1, original(self, step, batch)))
    out = tmp_path / "out"
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out, run={"steps": 2},
                   rollout={"drafter_training": {"every": 1, "updates": 1, "batch_size": 4}},
                   trl={"save_strategy": "steps", "save_steps": 2})
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and sorted(rounds) == [1, 2]  # one row per step
    for row in rows:
        for key in ("drafter_est_tau", "drafter_est_tau_initial", "drafter_loss", "drafter_s", "drafter_features_s"):
            assert row[key] == pytest.approx(rounds[row["step"]][key]), (row["step"], key)
    assert rows[1]["drafter_est_tau"] >= 1 and "head tau" in (out / "summary.md").read_text()


def test_one_step_with_placement_ray(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray, monkeypatch):
    """The CLI's rollouts come from the Ray pool, whose actor loads model.target."""
    from rollout.ray.actor_pool import RolloutPool
    from scripts.train_trl import main

    specs = []
    original = RolloutPool.__init__
    monkeypatch.setattr(RolloutPool, "__init__",
                        lambda self, spec, *a, **kw: specs.append(spec) or original(self, spec, *a, **kw))
    out = tmp_path / "out"
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out,
                   rollout={"placement": "ray", "num_actors": 1, "threads_per_actor": 1})
    assert main(["--config", str(path)]) == 0
    assert [s.target.path for s in specs] == [str(tiny_policy_dir)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["tau"] >= 1
