"""A run folder survives any single kill and resumes only what belongs to it (no Ray here):
checkpoints cut short at every point of a save, torn log lines, the config snapshot and
the --fresh fence, and the non-finite guards on a toy model."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import pytest
import torch

from rollout.config import ConfigError
from tests.trainers.conftest import model_and_optimizer, write_config
from trainers.grpo import checkpoint as ck
from trainers.grpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainers.grpo.guards import NonFiniteError, check_loss_and_grad, check_weights
from trainers.grpo.report import MetricsLogger, read_jsonl, read_metrics


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException, so no `except Exception` catches it)."""


def _kill(*_a, **_k):
    raise Killed


# every call a save makes that touches the disk, in order
KILL_POINTS = {
    "tmp mkdir": (pathlib.Path, "mkdir"),
    "weights": (ck, "save_file"),
    "optimizer": (torch, "save"),
    "drafter copy": (shutil, "copytree"),
    "state.json data": (os, "fsync"),
    "state.json rename": (os, "replace"),
    "remove old final": (shutil, "rmtree"),
    "rename into place": (pathlib.Path, "rename"),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_kill_at_any_point_of_a_save_leaves_a_resumable_folder(point, tmp_path, monkeypatch):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    model, opt = model_and_optimizer()
    save_checkpoint(tmp_path, 2, model, opt, {"version": 2}, head)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    target, name = KILL_POINTS[point]
    with monkeypatch.context() as m:
        m.setattr(target, name, _kill)
        with pytest.raises(Killed):
            save_checkpoint(tmp_path, 4, model, opt, {"version": 4}, head)
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "step_000002", found  # the .tmp folder is never taken
    fresh, fresh_opt = model_and_optimizer(seed=9)
    state = load_checkpoint(found, fresh, fresh_opt)
    assert state["step"] == 2 and state["version"] == 2
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the next save of the resumed run goes through
    save_checkpoint(tmp_path, 4, fresh, fresh_opt, {"version": 4}, head)
    assert latest_checkpoint(tmp_path).name == "step_000004"


def test_latest_checkpoint_skips_tmp_folders_and_unreadable_states(tmp_path, caplog):
    model, opt = model_and_optimizer()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, opt, {"version": step})
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_000004", root / "step_000006.tmp")  # a save cut short, complete-looking
    (root / "step_000006.tmp" / "state.json").write_text(json.dumps({"step": 6}))
    (root / "step_000010").mkdir()  # an empty folder (kill right after mkdir of a final name)
    assert latest_checkpoint(tmp_path).name == "step_000004"
    state = root / "step_000004" / "state.json"
    state.write_text(state.read_text()[:50])  # torn
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path).name == "step_000002"
    assert "step_000004" in caplog.text
    assert latest_checkpoint(tmp_path / "nothing") is None


# ---------------------------------------------------------------------------- logs
def test_torn_last_log_line_is_dropped_with_a_warning(tmp_path, caplog):
    good = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3))
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (tmp_path / name).write_text(good + '{"step": 4, "lo')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "torn last line 4" in caplog.text
    logger = MetricsLogger(tmp_path, resume_step=2)  # a resume from step 2 rewrites both logs
    logger.log(3, {"loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / "rollouts.jsonl")] == [1, 2]


def test_corrupt_line_before_the_last_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: corrupt log line"):
        read_metrics(tmp_path)


# ---------------------------------------------------------------------------- what belongs to a run
def _cfg(tmp_path, policy, head, **sections):
    from trainers.grpo.config import load_train_config

    path = write_config(tmp_path / "c.yaml", policy, head, tmp_path / "run", **sections)
    return load_train_config(path)


def _fake_run(cfg, steps=(1, 2, 3)):
    """What a run leaves: a snapshot and checkpoints (a toy model stands in for the policy)."""
    from trainers.grpo.run_dir import prepare_run_dir

    assert prepare_run_dir(cfg) is None
    model, opt = model_and_optimizer()
    for s in steps:
        save_checkpoint(cfg.run.out_dir, s, model, opt, {"version": s})


@pytest.mark.parametrize("sections, listed", [
    ({"run": {"seed": 4}}, "run.seed: 3 -> 4"),
    ({"rollout": {"verifier": {"name": "lossless", "params": {}}}}, "rollout.verifier.name: 'mars' -> 'lossless'"),
    ({"task": {"difficulty": 2}}, "task.difficulty: 1 -> 2"),
    ({"model": {"drafter": None}, "rollout": {"spec": {"mode": "off"}}}, "model.drafter:"),
    # the law of a lossy verifier's rollouts depends on what it verifies, and every rule's on the copy rounded
    ({"rollout": {"spec": {"mode": "chain", "num_draft_tokens": 3, "draft_sampling": "greedy"}}},
     "rollout.spec.draft_sampling: 'sampled' -> 'greedy'"),
    ({"rollout": {"backend_options": {"weights": "bfloat16"}}}, "rollout.backend_options.weights: 'exact' -> 'bfloat16'"),
])
def test_resume_with_a_different_config_is_refused(sections, listed, tmp_path, tiny_policy_dir, tiny_head_dir):
    from trainers.grpo.run_dir import resume_point

    _fake_run(_cfg(tmp_path, tiny_policy_dir, tiny_head_dir))
    changed = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, **sections)
    with pytest.raises(ConfigError, match="run.resume") as err:
        resume_point(changed)
    assert listed in str(err.value)
    allowed = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, **{**sections, "run": {
        **sections.get("run", {}), "allow_config_change": True}})
    assert resume_point(allowed).name == "step_000003"
    # changing what does not alter the checkpoints' meaning is fine
    longer = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, run={"steps": 9}, optim={"lr": 1e-4})
    assert resume_point(longer).name == "step_000003"


def test_cli_refuses_a_foreign_resume_before_ray(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    import ray

    from scripts.train import main

    _fake_run(_cfg(tmp_path, tiny_policy_dir, tiny_head_dir))
    path = write_config(tmp_path / "c2.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "run", run={"seed": 5})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'run.resume'") and "run.seed: 3 -> 5" in err, err
    assert not ray.is_initialized()


def test_a_complete_run_starts_nothing(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    """Run again after its last step, a run says it is complete and shows its summary, without
    starting Ray or loading a model; with more steps it goes on (not here: that is the resume test)."""
    import ray

    from scripts.train import main

    cfg = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir)
    _fake_run(cfg, steps=(cfg.run.steps,))
    (tmp_path / "run" / "summary.md").write_text("| the table |\n")
    path = tmp_path / "c.yaml"
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "this run is complete: " in out and f"is step {cfg.run.steps} of run.steps = {cfg.run.steps}" in out, out
    assert "| the table |" in out and not ray.is_initialized()
    assert latest_checkpoint(cfg.run.out_dir).name == f"step_{cfg.run.steps:06d}"


def test_fresh_fences_off_the_previous_run(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    from trainers.grpo.run_dir import prepare_run_dir, read_snapshot

    _fake_run(_cfg(tmp_path, tiny_policy_dir, tiny_head_dir))  # an old run reached step 3
    run = tmp_path / "run"
    logs = {"metrics.jsonl": '{"step": 3}\n', "rollouts.jsonl": '{"step": 3}\n', "summary.md": "old\n",
            "tb/events.out.tfevents.1": "x", "plots/reward.png": "png"}
    for name, text in logs.items():  # and wrote its logs, events and figures
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    (run / "notes.txt").write_text("the user's")  # not a run output: stays
    fresh = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, run={"resume": False, "seed": 8})
    assert prepare_run_dir(fresh) is None
    assert ("moved the previous run's checkpoints, config.json, metrics.jsonl, rollouts.jsonl, tb, summary.md, "
            "plots to") in capsys.readouterr().out
    assert latest_checkpoint(fresh.run.out_dir) is None
    moved = list((run / "superseded").glob("*/checkpoints/step_000003"))
    assert len(moved) == 1
    old = moved[0].parent.parent
    assert {name: (old / name).read_text() for name in logs} == logs  # nothing of the old run lost
    assert not any((run / name).exists() for name in ("metrics.jsonl", "rollouts.jsonl", "summary.md", "tb", "plots"))
    assert (run / "notes.txt").read_text() == "the user's"
    assert read_snapshot(fresh.run.out_dir)["run"]["seed"] == 8
    # the new run checkpoints step 1 and is killed; a resume takes its step 1, never the old step 3
    model, opt = model_and_optimizer()
    save_checkpoint(fresh.run.out_dir, 1, model, opt, {"version": 1})
    again = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, run={"seed": 8})
    assert prepare_run_dir(again).name == "step_000001"


# ---------------------------------------------------------------------------- non-finite guards
def test_guards_name_the_step_and_the_quantity():
    model, _ = model_and_optimizer()
    check_loss_and_grad(3, 0.5, torch.tensor(1.0))
    check_weights(3, model)
    with pytest.raises(NonFiniteError, match="step 3: loss is not finite"):
        check_loss_and_grad(3, float("nan"), 1.0)
    with pytest.raises(NonFiniteError, match="step 3: gradient norm is not finite"):
        check_loss_and_grad(3, 0.5, torch.tensor(float("inf")))
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 7: updated weights is not finite \(bias: 1 of 3"):
        check_weights(7, model)


def test_a_non_finite_checkpoint_is_refused_on_load(tmp_path):
    model, opt = model_and_optimizer()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    path = save_checkpoint(tmp_path, 5, model, opt, {"version": 5})
    fresh, fresh_opt = model_and_optimizer(seed=1)
    with pytest.raises(NonFiniteError, match="step 5: checkpoint step_000005 is not finite .*weight holds NaN"):
        load_checkpoint(path, fresh, fresh_opt)


class _RecordingPool:
    """Stands for the Ray rollout pool at start-up: records the weights' version it is sent."""

    def __init__(self, *args, **kwargs):
        self.versions = []

    def set_weights(self, state, version):
        self.versions.append(version)

    def shutdown(self):
        pass


def _policy_step(trainer) -> None:
    """One AdamW step of the trainer's policy on a loss whose gradient is not zero."""
    from trainers.grpo.policy import completion_logprobs

    trainer.optimizer.zero_grad(set_to_none=True)
    logp, mask = completion_logprobs(trainer.policy, [[5, 9, 14, 3], [11, 4, 6]], [[40, 41, 42], [43, 44]],
                                     temperature=1.0)
    (-(logp * torch.tensor([[1.0], [-0.5]]))[mask].sum()).backward()
    grads = [p.grad for p in trainer.policy.parameters() if p.grad is not None]
    assert grads and max(float(g.abs().max()) for g in grads) > 1e-4  # a real step
    trainer.optimizer.step()


def test_resume_restores_policy_optimizer_rng_and_version(tmp_path, tiny_policy_dir, monkeypatch):
    """The trainer's own resume (GRPOTrainer.start, the pool a stub): a run checkpointed after
    one step and resumed continues exactly as the uninterrupted run: the second AdamW step (whose
    moments come from the first) gives the same weights, the RNG streams continue where they
    were, and the policy version (what the actors are told) is the saved one."""
    import random

    from trainers.grpo import loop
    from trainers.grpo.config import load_train_config

    pools = []
    monkeypatch.setattr(loop, "RolloutPool", lambda *a, **k: pools.append(_RecordingPool()) or pools[-1])
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "run", run={"steps": 3},
                        rollout={"spec": {"mode": "off"}})
    full = loop.GRPOTrainer(load_train_config(path))
    full.start()
    _policy_step(full)
    full.version = 1
    full.save(1)
    full.logger.close()
    draws = (torch.rand(4), random.random())  # what the next step would draw
    _policy_step(full)
    after_two = {k: v.clone() for k, v in full.policy.state_dict().items()}

    torch.manual_seed(123), random.seed(123)  # a new process: other RNG states
    resumed = loop.GRPOTrainer(load_train_config(path))
    resumed.start()
    resumed.logger.close()
    assert (resumed.start_step, resumed.version) == (1, 1)
    assert pools[-1].versions == [1]
    assert torch.equal(torch.rand(4), draws[0]) and random.random() == draws[1]
    _policy_step(resumed)
    for name, value in resumed.policy.state_dict().items():
        torch.testing.assert_close(value, after_two[name], rtol=0, atol=1e-7, msg=name)


def test_a_resume_takes_the_configs_optimizer_settings_and_the_saved_moments(tmp_path, caplog):
    """run_dir lets the optimizer's settings change on resume: the config's lr applies (torch's
    load_state_dict alone would bring back the saved one), the moments are the saved ones."""
    model, opt = model_and_optimizer()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, model, opt, {"version": 1}, None)
    fresh = model_and_optimizer(seed=9)[0]
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-7, weight_decay=0.5)
    with caplog.at_level("WARNING"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000001", fresh, fresh_opt)
    group = fresh_opt.param_groups[0]
    assert group["lr"] == 1e-7 and group["weight_decay"] == 0.5
    assert "optim.lr" in caplog.text and "optim.weight_decay" in caplog.text
    for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_a_resume_with_no_checkpoint_left_fences_the_old_logs(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    """A finished run whose checkpoints were deleted (1.6 GB each) restarts at step 0: its logs,
    summary and figures move to superseded/ first, as with --fresh, instead of being emptied."""
    import shutil

    from trainers.grpo.run_dir import prepare_run_dir

    cfg = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir)
    _fake_run(cfg)
    run = tmp_path / "run"
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    (run / "summary.md").write_text("old\n")
    shutil.rmtree(run / "checkpoints")
    assert prepare_run_dir(cfg) is None
    assert "no checkpoint to resume from: moved the previous run's" in capsys.readouterr().out
    (old,) = (run / "superseded").iterdir()
    assert (old / "metrics.jsonl").read_text() == '{"step": 3}\n' and (old / "summary.md").read_text() == "old\n"
    assert not (run / "metrics.jsonl").exists()


def test_a_complete_run_that_died_before_its_summary_gets_one(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    """The last checkpoint was saved, then the run died before ``finish`` wrote summary.md and the
    plots: running it again rebuilds them from metrics.jsonl (it used to show nothing, for ever)."""
    import json

    from scripts.train import main

    cfg = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir)
    _fake_run(cfg, steps=(cfg.run.steps,))
    run = tmp_path / "run"
    rows = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.5, "loss": 0.2} for s in range(1, cfg.run.steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--config", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert "rebuilt from metrics.jsonl" in out and (run / "summary.md").is_file() and any((run / "plots").iterdir())
    assert (run / "summary.md").read_text().strip() in out
    assert main(["--config", str(tmp_path / "c.yaml")]) == 0  # now up to date: shown, not rebuilt
    assert "rebuilt" not in capsys.readouterr().out


def test_resume_compares_validated_configs(tmp_path, tiny_policy_dir, tiny_head_dir):
    """Not a difference: a rule's default parameters written out or left out, a field a newer
    version added (absent from an old snapshot), the speculation of a lossless run."""
    import json

    from trainers.grpo.run_dir import SNAPSHOT, resume_point

    mars = {"verifier": {"name": "mars", "params": {"theta": 0.9}}}
    _fake_run(_cfg(tmp_path, tiny_policy_dir, tiny_head_dir, rollout=mars))
    snap = tmp_path / "run" / SNAPSHOT
    old = json.loads(snap.read_text())
    del old["grpo"]["std_eps"]  # as a version before the field existed wrote it
    snap.write_text(json.dumps(old))
    bare = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, rollout={"verifier": {"name": "mars", "params": {}}})
    assert resume_point(bare).name == "step_000003"
    lossless = tmp_path / "lossless"
    lossless.mkdir()
    plain = {"verifier": {"name": "lossless", "params": {}}}
    _fake_run(_cfg(lossless, tiny_policy_dir, tiny_head_dir, rollout=plain))
    greedy = _cfg(lossless, tiny_policy_dir, tiny_head_dir, rollout={
        **plain, "spec": {"mode": "chain", "num_draft_tokens": 3, "draft_sampling": "greedy"}})
    assert resume_point(greedy).name == "step_000003"  # lossless: P = p whatever it drafts
