"""The study report on synthetic run folders: every number equals a direct computation from the
files (final accuracy and its interval, paired differences, curves, training totals, speed
ratios), unfinished runs and stale evaluations are left out, and --report-only starts nothing."""

from __future__ import annotations

import json
import random

import pytest

from tests.trainers.study.conftest import write_study
from trainers.study import stats
from trainers.study.config import load_study_config
from trainers.study.evaluate import eval_key, heldout_problems
from trainers.study.grid import plan_runs
from trainers.study.report import read_run, summarise, write_report

SETTINGS = {
    "lossless": {"verifier": {"name": "lossless"}},
    "mars_none": {"verifier": {"name": "mars", "params": {"theta": 0.9}, "test": "law"}},
    "mars_tis": {"verifier": {"name": "mars", "params": {"theta": 0.9}, "test": "law"},
                 "correction": {"mode": "token_tis", "cap": 2.0}},
}
P_CORRECT = {"lossless": 0.5, "mars_none": 0.3, "mars_tis": 0.45}


@pytest.fixture
def study(tmp_path, tiny_policy_dir, tiny_head_dir):
    """Two seeds of three settings, written by hand; mars_none seed 1 stopped after step 1."""
    path = write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study", settings=SETTINGS,
                       study={"seeds": [0, 1], "bootstrap_draws": 400},
                       eval={"problems_per_difficulty": 10})
    cfg = load_study_config(path)
    plans = plan_runs(cfg)
    ids = [p.id for p in heldout_problems(cfg.eval)]
    diffs = [p.difficulty for p in heldout_problems(cfg.eval)]
    rng = random.Random(0)
    truth = {}
    for plan in plans:
        plan.out_dir.mkdir(parents=True)
        last = 1 if (plan.setting, plan.seed) == ("mars_none", 1) else 2
        rows = [{"step": k, "rollout_s": rng.uniform(1, 3), "rollout_tokens": rng.randint(100, 300),
                 "tau": rng.uniform(1.5, 3), "kl_k1": rng.uniform(0, 0.1), "kl_k3": rng.uniform(0, 0.1),
                 "is_ess": rng.uniform(0.5, 1), "step_s": rng.uniform(5, 9), "rollout_tokens_per_s": 100.0}
                for k in range(1, last + 1)]
        (plan.out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        records = []
        for step in range(last + 1):
            for t in cfg.eval.temperatures:
                correct = [int(rng.random() < P_CORRECT[plan.setting]) for _ in ids]
                truth[plan.setting, plan.seed, t, step] = correct
                records.append({"step": step, "temperature": t, "key": eval_key(cfg.eval, t, 8), "ids": ids,
                                "difficulty": diffs, "correct": correct, "length": [5] * len(ids),
                                "accuracy": sum(correct) / len(ids), "digest": "x", "eval_s": 1.0})
        # an evaluation of other settings (another max_new_tokens): not this study's, ignored
        records.append({**records[-1], "step": 2, "key": eval_key(cfg.eval, 0.0, 99), "correct": [1] * len(ids)})
        (plan.out_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        truth[plan.setting, plan.seed, "rows"] = rows
    return cfg, plans, ids, truth


def test_summary_numbers_equal_direct_computation(study):
    cfg, plans, ids, truth = study
    runs = [read_run(p, cfg) for p in plans]
    assert [(r["setting"], r["seed"], r["finished"]) for r in runs if not r["finished"]] == [("mars_none", 1, False)]
    s = summarise(cfg, plans, runs)["settings"]
    draws = cfg.study.bootstrap_draws

    for name in SETTINGS:
        for t in (0.0, 1.0):
            seeds = [0] if name == "mars_none" else [0, 1]
            grid = [truth[name, sd, t, 2] for sd in seeds]
            acc = s[name]["final"][f"{t:g}"]["accuracy"]
            assert acc["mean"] == pytest.approx(sum(map(sum, grid)) / (len(seeds) * len(ids)))
            assert acc["per_seed"] == pytest.approx([sum(g) / len(ids) for g in grid])
            assert (acc["ci_low"], acc["ci_high"]) == pytest.approx(stats.two_way_bootstrap(grid, draws, 0))
            by_d = s[name]["final"][f"{t:g}"]["by_difficulty"]["2"]
            half = [g[len(ids) // 2:] for g in grid]  # difficulty 2: the second half of the problems
            assert by_d["mean"] == pytest.approx(sum(map(sum, half)) / (len(seeds) * len(ids) // 2))

    def diff(a, b, t, seeds):
        return [[x - y for x, y in zip(truth[a, sd, t, 2], truth[b, sd, t, 2])] for sd in seeds]

    cmps = {(c["other"], c["kind"]): c["difference"] for c in s["mars_tis"]["final"]["1"]["comparisons"]}
    assert set(cmps) == {("lossless", "reference"), ("mars_none", "uncorrected")}
    ref = diff("mars_tis", "lossless", 1.0, [0, 1])
    assert cmps["lossless", "reference"]["mean"] == pytest.approx(sum(map(sum, ref)) / (2 * len(ids)))
    assert (cmps["lossless", "reference"]["ci_low"], cmps["lossless", "reference"]["ci_high"]) == pytest.approx(
        stats.two_way_bootstrap(ref, draws, 0))
    bare = diff("mars_tis", "mars_none", 1.0, [0])  # mars_none's seed 1 did not finish: paired on seed 0 only
    assert cmps["mars_none", "uncorrected"]["seeds"] == [0]
    assert cmps["mars_none", "uncorrected"]["mean"] == pytest.approx(sum(bare[0]) / len(ids))

    curve = s["mars_none"]["curves"]["0"]  # every run's evaluations, the unfinished one's too
    assert [p[0] for p in curve] == [0, 1]  # step 2: only seed 0 has it
    accs = [sum(truth["mars_none", sd, 0.0, 1]) / len(ids) for sd in (0, 1)]
    assert curve[1][1:] == pytest.approx((sum(accs) / 2, min(accs), max(accs)))

    tps = {sd: sum(r["rollout_tokens"] for r in truth["mars_tis", sd, "rows"])
           / sum(r["rollout_s"] for r in truth["mars_tis", sd, "rows"]) for sd in (0, 1)}
    assert s["mars_tis"]["training"]["tokens_per_s"]["mean"] == pytest.approx(sum(tps.values()) / 2)
    ref_tps = {sd: sum(r["rollout_tokens"] for r in truth["lossless", sd, "rows"])
               / sum(r["rollout_s"] for r in truth["lossless", sd, "rows"]) for sd in (0, 1)}
    ratios = [tps[sd] / ref_tps[sd] for sd in (0, 1)]
    assert s["mars_tis"]["speed_vs_reference"]["tokens_per_s"]["mean"] == pytest.approx(sum(ratios) / 2)
    kl = [sum(r["kl_k1"] for r in truth["mars_tis", sd, "rows"]) / 2 for sd in (0, 1)]
    assert s["mars_tis"]["training"]["kl_k1"]["mean"] == pytest.approx(sum(kl) / 2)
    assert s["mars_none"]["seeds_finished"] == [0]


def test_report_files_and_report_only_cli(study, capsys):
    import ray

    from scripts.study import main

    cfg, plans, _, _ = study
    md, js, plots = write_report(cfg, plans, "test")
    summary = json.loads(js.read_text())
    assert set(summary["settings"]) == set(SETTINGS) and summary["provenance"]["command"] == "test"
    text = md.read_text()
    for name in SETTINGS:
        assert f"**{name}**" in text and f"| {name} |" in text
        for line in summary["settings"][name]["verdict"]:
            assert line in text
    assert "| mars_none | 1 | no | 1 |" in text  # the unfinished run is listed as such
    assert sorted(p.name for p in plots) == ["accuracy_over_steps.png", "final_differences.png", "rollout_speed.png",
                                             "training_over_steps.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    md.unlink()
    path = cfg.study.out_dir.rsplit("/", 1)[0] + "/s.yaml"
    assert main(["--config", path, "--report-only"]) == 0
    assert md.is_file() and "report:" in capsys.readouterr().out
    assert not ray.is_initialized()
