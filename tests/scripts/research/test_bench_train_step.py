"""scripts/research/bench_train_step on the tiny policy: the four variants run, compute the same
log-probs, and bad input exits with status 2 naming it."""

from __future__ import annotations

import json

from scripts.research import bench_train_step
from tests.trainers.conftest import write_config


def test_the_variants_agree(tmp_path, tiny_policy_dir, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "run", rollout={"spec": {"mode": "off"}})
    assert bench_train_step.main(["--config", str(cfg), "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "6 rows" in out and "micro-batch 4" in out
    lines = {name: out.split(name)[-1].split()[:3] for name in bench_train_step.VARIANTS}
    assert lines["all positions, batch order"][1] == "1.00x"
    for name, (seconds, speedup, diff) in lines.items():
        assert float(seconds) > 0 and speedup.endswith("x"), name
        assert float(diff) < 1e-4, name  # the same values, whatever the path


def test_completions_come_from_a_run_and_must_fill_the_batch(tmp_path, tiny_policy_dir, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "run", rollout={"spec": {"mode": "off"}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollouts.jsonl").write_text("".join(json.dumps({"step": 1, "completion_ids": [5, 6, 7]}) + "\n"
                                                for _ in range(4)))
    assert bench_train_step.main(["--config", str(cfg), "--from-run", str(run)]) == 2
    assert "holds 4 completions at step 1, the config's batch is 6" in capsys.readouterr().err
    assert bench_train_step.main(["--config", str(cfg), "--from-run", str(tmp_path / "nowhere")]) == 2
    assert "rollouts.jsonl does not exist" in capsys.readouterr().err
    assert bench_train_step.main(["--config", str(cfg), "--reps", "0"]) == 2
