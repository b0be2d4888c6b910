"""The study's parallel path on a local Ray: each run a Ray task with its own trainer and rollout
actor, two at once; and the refusal of a parallel layout whose tasks could not all start."""

from __future__ import annotations

import pytest

from rollout.config import ConfigError
from tests.trainers.study.conftest import write_study
from trainers.study.config import load_study_config
from trainers.study.evaluate import EvalLog
from trainers.study.grid import plan_runs
from trainers.study.runner import check_parallel_fits, run_state, run_study


@pytest.fixture(scope="module")
def ray4():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _study(tmp_path, policy, head, **study):
    run = {"steps": 1, "checkpoint_every": 1, "keep_checkpoints": None}
    return load_study_config(write_study(
        tmp_path / "s.yaml", policy, head, tmp_path / "study", study={"parallel": 2, "cpus_per_run": 1, **study},
        train={"run": run, "ray": {"num_cpus": 4}, "optim": {"lr": 1e-3, "micro_batch": 4}}))


def test_runs_as_parallel_ray_tasks(tmp_path, tiny_policy_dir, tiny_head_dir, ray4):
    cfg = _study(tmp_path, tiny_policy_dir, tiny_head_dir)
    plans = plan_runs(cfg)
    check_parallel_fits(cfg, plans)  # 2 x (1 task CPU + 1 actor thread) on 4 CPUs
    lines: list[str] = []
    outcomes = run_study(cfg, plans, say=lines.append)
    assert [(o.plan.setting, o.status) for o in outcomes] == [("lossless", "trained"), ("overshoot_tis", "trained")]
    assert sum("started as a Ray task" in line for line in lines) == 2
    for plan in plans:
        assert run_state(plan, cfg) == "done"
        assert [(r["step"], r["temperature"]) for r in EvalLog(plan.out_dir).records()] == [
            (0, 0.0), (0, 1.0), (1, 0.0), (1, 1.0)]
    assert [o.status for o in run_study(cfg, plans, say=lines.append)] == ["skipped", "skipped"]


def test_a_parallel_layout_that_cannot_start_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir):
    cfg = _study(tmp_path, tiny_policy_dir, tiny_head_dir, parallel=3)
    with pytest.raises(ConfigError) as err:
        check_parallel_fits(cfg, plan_runs(cfg))
    assert err.value.field == "study.parallel" and "at most 2" in str(err.value)


def test_a_relative_out_dir_is_refused_for_tasks_on_a_cluster(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from trainers.study.runner import check_out_dir

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _study(tmp_path, tiny_policy_dir, tiny_head_dir, out_dir="runs/relative")
    check_out_dir(cfg, plan_runs(cfg))  # a local Ray: the tasks share this machine's working directory
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ConfigError) as err:
        check_out_dir(cfg, plan_runs(cfg))
    assert err.value.field == "study.out_dir" and "absolute path" in str(err.value)
