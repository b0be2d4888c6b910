"""Drift reports (trainers.drift.report) on hand-built inputs: a training run's rollouts read back
as drift over steps (``from_run``, ``step_stats``), and a study's runs compared (``build_report``):
speedups, accuracy gaps, sequence ESS, the KL summary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trainers.drift.report import build_report, from_run, step_stats
from trainers.drift.study import parse_verifier

def _synthetic_run(path, steps: int = 3, per_step: int = 4):
    g = torch.Generator().manual_seed(0)
    lines = []
    for s in range(1, steps + 1):
        for _ in range(per_step):
            n = 5
            beh = (-torch.rand(n, generator=g) * 2).tolist()
            tgt = [b - 0.1 * s for b in beh]  # drift grows with the step
            pol = [t + 0.05 for t in tgt]
            lines.append(json.dumps({"step": s, "completion_ids": list(range(n)), "behaviour_logprobs": beh,
                                     "target_logprobs": tgt, "policy_logprobs": pol, "relaxed": [1, 0, 0, 1, 0],
                                     "weights": [math.exp(p - b) for p, b in zip(pol, beh)], "reward": 1.0 * (s > 1),
                                     "text": "x"}))
    (path / "rollouts.jsonl").write_text("\n".join(lines) + "\n")


def test_from_run_plots_drift_over_steps(tmp_path):
    _synthetic_run(tmp_path)
    files = from_run(tmp_path, tmp_path / "drift")
    rows = json.loads((tmp_path / "drift" / "run_drift.json").read_text())["steps"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for s, r in enumerate(rows, start=1):
        assert abs(r["kl_P_p_k1"] - 0.1 * s) < 1e-9 and r["relaxed_frac"] == 0.4 and r["tokens"] == 20
        assert abs(r["kl_P_pi_k1"] - (0.1 * s - 0.05)) < 1e-9
        assert abs(r["stale_abs_mean"] - 0.05) < 1e-9 and 0 < r["weight_ess"] <= 1
    assert rows[2]["kl_P_p_k3"] > rows[0]["kl_P_p_k3"] and rows[0]["reward_mean"] == 0.0
    assert all(f.stat().st_size > 0 for f in files)
    from scripts.drift import main

    assert main(["--from-run", str(tmp_path), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "drift_over_steps.png").is_file()


def test_from_run_rejects_bad_records(tmp_path):
    (tmp_path / "rollouts.jsonl").write_text(json.dumps({"step": 1, "completion_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="missing fields"):
        from_run(tmp_path, tmp_path / "out")
    assert step_stats([{"behaviour_logprobs": [0.0], "target_logprobs": [0.0], "policy_logprobs": [0.0],
                        "relaxed": [0], "weights": [1.0], "reward": 1.0}])["seq_ess"] == 1.0


def test_a_runs_step_view_weights_whole_sequences_by_policy_over_behaviour():
    """The step view's sequence ratio is prod_t pi / P (policy_logprobs over behaviour_logprobs),
    not the rollout's p / P: here p = P, and the two sequences' ratios are 1 and 3."""
    beh = [[-1.0, -2.0], [-0.5, -1.5]]
    pol = [[-1.0, -2.0], [-0.5 + math.log(3.0), -1.5]]
    records = [{"behaviour_logprobs": b, "target_logprobs": b, "policy_logprobs": p, "relaxed": [0, 0],
                "weights": [1.0, 1.0], "reward": 0.0} for b, p in zip(beh, pol)]
    row = step_stats(records)
    assert row["seq_log_ratio_mean"] == pytest.approx(math.log(3.0) / 2, abs=1e-12)
    assert row["seq_ess"] == pytest.approx(16 / 20, abs=1e-12)  # (1 + 3)^2 / (2 (1 + 9))
    assert (row["kl_P_p_k1"], row["kl_P_p_k3"]) == (0.0, 0.0)


def _run_data(key, kind, mode, verifier, baseline, tokens_per_s, correct, seq_log_ratio, length):
    from trainers.drift.run import RunData
    from trainers.drift.study import RunSpec

    n_tok = len(correct) * length
    tok = {k: [torch.zeros(n_tok, dtype=torch.float64)] for k in
           ("tv", "kl", "entropy_P", "entropy_p", "relaxed", "uncovered", "logP_err", "position")}
    return RunData(spec=RunSpec(key, kind, mode, parse_verifier(verifier), baseline), tokens=tok,
                   seq_log_ratio=list(seq_log_ratio), rewards=[float(c) for c in correct],
                   difficulties=[1] * len(correct), lengths=[length] * len(correct),
                   timings={"tokens": float(n_tok), "total_s": n_tok / tokens_per_s, "cpu_s": 2 * n_tok / tokens_per_s,
                            "emitted": float(n_tok), "row_rounds": float(n_tok) / 2})


def test_report_speedups_gaps_and_sequence_ess_on_hand_built_runs():
    """compare(): speedups are this configuration's tokens/s over lossless's (same mode) and over
    plain sampling's; the accuracy gap is this configuration minus its baseline; the sequence
    ESS is that of the weights prod p / P = exp(seq_log_ratio)."""
    runs = [_run_data("plain", "baseline", "off", "lossless", None, 10.0, [1] * 50 + [0] * 50, [0.0] * 100, 4),
            _run_data("lossless@chain", "verifier", "chain", "lossless", "plain", 20.0, [1] * 50 + [0] * 50,
                      [0.0] * 100, 4),
            _run_data("mars:theta=0.9@chain", "verifier", "chain", "mars:theta=0.9", "plain", 30.0,
                      [1] * 30 + [0] * 70, [0.0] * 98 + [0.0, math.log(3.0)], 2)]
    c = build_report(runs, {})["configurations"]
    mars = c["mars:theta=0.9@chain"]
    assert mars["speedup_vs_lossless"] == pytest.approx(1.5) and mars["speedup_vs_autoregressive"] == pytest.approx(3.0)
    assert mars["cpu_speedup_vs_lossless"] == pytest.approx(1.5)
    assert c["lossless@chain"]["speedup_vs_autoregressive"] == pytest.approx(2.0)
    assert mars["length_vs_baseline"] == pytest.approx(0.5)
    gap = mars["vs_baseline"]
    assert gap["baseline"] == "plain" and gap["diff"] == pytest.approx(0.3 - 0.5)
    assert gap["diff_ci_low"] < -0.2 < gap["diff_ci_high"]
    assert mars["seq_ess"] == pytest.approx(102 ** 2 / (100 * (99 + 9)), abs=1e-12)  # 99 ones and a 3
    assert mars["tau"] == pytest.approx(2.0)


def test_the_kl_summary_reports_the_share_of_infinite_kl_and_the_mean_of_the_finite_ones():
    """``summarise``: KL(P || p) is infinite where P puts mass outside p's support; the report gives
    the fraction of such tokens (``inf_frac``) and the statistics of the finite values."""
    run = _run_data("mars:theta=0.9@chain", "verifier", "chain", "mars:theta=0.9", "plain", 10.0, [1] * 4, [0.0] * 4, 2)
    run.tokens["kl"] = [torch.tensor([0.1, math.inf, 0.3, 0.2, math.inf, 0.0, 0.4, 0.2], dtype=torch.float64)]
    kl = build_report([run], {})["configurations"]["mars:theta=0.9@chain"]["kl"]
    assert kl["inf_frac"] == pytest.approx(2 / 8) and kl["mean"] == pytest.approx(1.2 / 6)


def test_the_table_and_the_position_plot_show_the_share_of_infinite_kl(tmp_path, monkeypatch):
    """drift.md's KL mean / p99 and the per-position KL curve are over the finite values: the
    share of infinite KL stands next to them (a column; the configuration's legend entry)."""
    import trainers.drift.plots as plots
    from trainers.drift.report import markdown_table

    runs = [_run_data(key, "verifier", "chain", "mars:theta=0.9", None, 10.0, [1] * 4, [0.0] * 4, 2)
            for key in ("mars:theta=0.9@chain", "lossless@chain")]
    runs[0].tokens["kl"] = [torch.tensor([0.1, math.inf, 0.3, 0.2, math.inf, 0.0, 0.4, 0.2], dtype=torch.float64)]
    report = build_report(runs, {})
    lines = markdown_table(report).splitlines()
    col = [c.strip() for c in lines[0].split("|")].index("KL inf")
    cells = {line.split("|")[1].strip(): line.split("|")[col].strip() for line in lines[2:]}
    assert cells == {"mars:theta=0.9@chain": "25.00%", "lossless@chain": "0.00%"}
    legends = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: legends.append(
        [t.get_text() for t in fig.axes[1].get_legend().get_texts()]) or save(fig, path))
    plots.plot_drift_positions(report["configurations"], tmp_path / "positions.png")
    assert legends == [["mars:theta=0.9@chain (KL inf 25.00%)", "lossless@chain"]]


def test_a_runs_step_view_shows_k1_where_k3_misses_the_targets_mass_off_a_point_mass(tmp_path, monkeypatch):
    """A token emitted outright (P = 1, e.g. MARS relaxing on a tree node) with p = 0.4: KL(P || p) =
    -log 0.4, which k1 gives and k3 misses by p's other 0.6; ``run_drift.md`` and the drift plot
    show both."""
    import trainers.drift.plots as plots

    rec = {"step": 1, "completion_ids": [5], "behaviour_logprobs": [0.0], "target_logprobs": [math.log(0.4)],
           "policy_logprobs": [math.log(0.4)], "relaxed": [1], "weights": [0.4], "reward": 1.0}
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(rec) + "\n")
    labels = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: labels.append(
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]) or save(fig, path))
    from_run(tmp_path, tmp_path / "drift")
    row = json.loads((tmp_path / "drift" / "run_drift.json").read_text())["steps"][0]
    assert row["kl_P_p_k1"] == row["kl_P_pi_k1"] == pytest.approx(-math.log(0.4))
    assert row["kl_P_p_k3"] == pytest.approx(-math.log(0.4) - 0.6)
    head = (tmp_path / "drift" / "run_drift.md").read_text().splitlines()[2]
    assert {"kl_P_p_k1", "kl_P_p_k3", "kl_P_pi_k1", "kl_P_pi_k3"} <= {c.strip() for c in head.split("|")}
    assert {"KL(P||p) k1 (rollout target)", "KL(P||pi) k1 (trainer policy)"} <= set(labels[0])


def test_a_runs_step_view_counts_dropped_tokens_in_the_ess_and_staleness_in_absolute_value():
    """``step_stats``: the token ESS counts tokens the correction dropped (weight 0) as weights of 0,
    as ``effective_sample_size`` defines it; the staleness is the mean of |log pi - log p|, so
    drifts of both signs do not cancel."""
    beh = [[-1.0, -2.0, -0.5], [-0.7, -1.2]]
    tgt = [[-1.2, -1.8, -0.5], [-0.4, -1.2]]  # log p - log pi_old below: +0.2, -0.2, 0, -0.3, 0
    pol = [[-1.0, -2.0, -0.5], [-0.7, -1.2]]
    weights = [[1.0, 0.0, 1.0], [2.0, 0.0]]
    records = [{"behaviour_logprobs": b, "target_logprobs": t, "policy_logprobs": p, "relaxed": [0] * len(b),
                "weights": w, "reward": 1.0} for b, t, p, w in zip(beh, tgt, pol, weights)]
    row = step_stats(records)
    assert row["weight_ess"] == pytest.approx(4.0 ** 2 / (5 * 6.0))  # (1 + 1 + 2)^2 / (5 (1 + 1 + 4))
    assert row["masked_frac"] == pytest.approx(2 / 5)
    assert row["stale_abs_mean"] == pytest.approx((0.2 + 0.2 + 0.3) / 5)
