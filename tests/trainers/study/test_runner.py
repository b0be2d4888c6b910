"""The study's runs on a tiny policy with real Ray actors: each a GRPO run folder with its held-out
evaluations; a finished run is skipped without starting a trainer; a run interrupted after its
first checkpoint resumes there; the evaluation saw the policy in memory (it equals one of the
saved policy); a trained run without its final evaluation is evaluated from its checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.trainers.study.conftest import write_study
from trainers.grpo.loop import GRPOTrainer
from trainers.study.config import load_study_config
from trainers.study.evaluate import EvalLog, evaluate_checkpoint
from trainers.study.grid import plan_runs
from trainers.study.runner import run_state, run_study


def _steps(path, name="metrics.jsonl"):
    return [json.loads(line)["step"] for line in (path / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_policy_dir, tiny_head_dir, local_ray):
    tmp = tmp_path_factory.mktemp("study")
    # a random policy earns no reward, so its advantages and gradients are 0: the weight decay alone
    # moves it (p *= 1 - lr wd each step), enough to change its samples
    cfg = load_study_config(write_study(tmp / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp / "study",
                                        train={"optim": {"lr": 1e-3, "micro_batch": 4, "weight_decay": 50.0}}))
    plans = plan_runs(cfg)
    lines: list[str] = []
    outcomes = run_study(cfg, plans, say=lines.append)
    return cfg, plans, outcomes, lines


def test_each_run_is_a_grpo_run_folder_with_its_evaluations(trained):
    from trainers.grpo.compare import load_run

    cfg, plans, outcomes, lines = trained
    assert [(o.plan.setting, o.status) for o in outcomes] == [("lossless", "trained"), ("overshoot_tis", "trained")]
    for plan in plans:
        assert _steps(plan.out_dir) == [1, 2]
        recs = EvalLog(plan.out_dir).records()
        assert [(r["step"], r["temperature"]) for r in recs] == [(s, t) for s in (0, 1, 2) for t in (0.0, 1.0)]
        assert load_run(plan.out_dir).config["correction"]["mode"] == plan.config.correction.mode  # compare_runs reads it
        assert run_state(plan, cfg) == "done"
    base = [EvalLog(p.out_dir).records()[:2] for p in plans]  # step 0: the same base policy, the same draws
    assert [r["digest"] for r in base[0]] == [r["digest"] for r in base[1]]
    assert any(line.startswith("[1/2] lossless seed 0: step 2/2  held-out T=0 ") and "study ETA" in line for line in lines)
    assert any(line.startswith("[2/2] overshoot_tis seed 0: trained in ") for line in lines)


def test_the_evaluation_saw_the_policy_in_memory(trained):
    cfg, plans, _, _ = trained
    plan = plans[1]
    saved = evaluate_checkpoint(plan.out_dir / "checkpoints" / "step_000002", cfg.eval, plan.config)
    final = [r for r in EvalLog(plan.out_dir).records() if r["step"] == 2]
    first = [r for r in EvalLog(plan.out_dir).records() if r["step"] == 0]
    for a, b in zip(saved, final):
        assert (a["step"], a["key"], a["correct"], a["length"], a["digest"]) == (
            b["step"], b["key"], b["correct"], b["length"], b["digest"])
    assert final[1]["digest"] != first[1]["digest"]  # the trained policy samples differently at T = 1


def test_finished_runs_are_skipped_without_a_trainer(trained, monkeypatch):
    cfg, plans, _, _ = trained

    def refuse(*a, **k):
        raise AssertionError("a trainer was started for a finished run")
    monkeypatch.setattr(GRPOTrainer, "__init__", refuse)
    lines: list[str] = []
    outcomes = run_study(cfg, plans, say=lines.append)
    assert [o.status for o in outcomes] == ["skipped", "skipped"]
    assert lines == ["[1/2] lossless seed 0: done before (final checkpoint and evaluation), skipped",
                     "[2/2] overshoot_tis seed 0: done before (final checkpoint and evaluation), skipped"]


def test_a_trained_run_missing_its_final_evaluation_is_evaluated_from_its_checkpoint(trained, monkeypatch):
    cfg, plans, _, _ = trained
    plan = plans[0]
    log = EvalLog(plan.out_dir)
    before = log.records()
    log.truncate_after(1)
    assert run_state(plan, cfg) == "evaluate"
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trainer")))
    outcomes = run_study(cfg, plans, say=lambda line: None)
    assert [o.status for o in outcomes] == ["evaluated", "skipped"]
    after = log.records()
    assert [(r["step"], r["digest"], r["correct"]) for r in after] == [(r["step"], r["digest"], r["correct"]) for r in before]


def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray, monkeypatch):
    settings = {"lossless": {"verifier": {"name": "lossless"}}}
    cfg = load_study_config(write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study",
                                        settings=settings))
    plans = plan_runs(cfg)
    run = plans[0].out_dir
    step = GRPOTrainer.step

    def crash_at_second_step(self, k):
        if k == 1:
            raise RuntimeError("injected crash in step 2")
        return step(self, k)
    monkeypatch.setattr(GRPOTrainer, "step", crash_at_second_step)
    outcomes = run_study(cfg, plans, say=lambda line: None)
    assert outcomes[0].status == "failed" and "injected crash" in outcomes[0].error
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    assert _steps(run) == [1] and run_state(plans[0], cfg) == "resume"

    monkeypatch.setattr(GRPOTrainer, "step", step)
    starts = []
    start = GRPOTrainer.start

    def record_start(self):
        start(self)
        starts.append(self.start_step)
    monkeypatch.setattr(GRPOTrainer, "start", record_start)
    outcomes = run_study(cfg, plans, say=lambda line: None)
    assert outcomes[0].status == "trained" and starts == [1]
    assert _steps(run) == [1, 2] and run_state(plans[0], cfg) == "done"
    recs = EvalLog(run).records()
    assert [(r["step"], r["temperature"]) for r in recs] == [(s, t) for s in (0, 1, 2) for t in (0.0, 1.0)]
