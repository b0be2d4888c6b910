"""scripts/train_trl.py: a bad config is refused before any model loads (rc 2, the dotted
field named), and a one-step run on the tiny policy leaves metrics, summary and plots."""

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


@pytest.mark.parametrize("section, values, field", [
    ("rollout", {"verifier": {"name": "mystery"}}, "rollout.verifier.name"),
    ("rollout", {"placement": "cloud"}, "rollout.placement"),
    ("rollout", {"drafter": "x"}, "rollout.drafter"),
    ("correction", {"mode": "geo_mis"}, "correction.mode"),
    ("trl", {"top_k": 50}, "trl.top_k"),
    ("trl", {"output_dir": "x"}, "trl.output_dir"),
    ("trl", {"num_generation": 4}, "trl.num_generation"),
    ("run", {"generation": "vllm"}, "run.generation"),
])
def test_bad_config_exits_2_naming_the_field(tmp_path, tiny_policy_dir, tiny_head_dir, capsys, section, values,
                                             field):
    from scripts.train_trl import main

    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out", **{section: values})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"config field '{field}'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


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


def test_one_step_leaves_the_run_outputs(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    from scripts.train_trl import main

    out = tmp_path / "out"
    path = _config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out)
    assert main(["--config", str(path)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 1
    for key in ("reward_mean", "tau", "relaxed_frac", "kl_k3", "is_ess", "rollout_tokens_per_s", "loss"):
        assert key in rows[0], key
    assert rows[0]["relaxed_frac"] > 0 and rows[0]["kl_k3"] > 0  # overshoot relaxes on the tiny model
    for name in ("summary.md", "plots/reward.png", "plots/tau.png", "plots/drift.png"):
        assert (out / name).is_file(), name
    assert "step 1/1" in capsys.readouterr().out


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
