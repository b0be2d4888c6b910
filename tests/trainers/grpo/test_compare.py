"""scripts/compare_runs: windowed means, config differences and the figure, on run folders
written the way the trainer writes them (metrics.jsonl, config.json from a real config)."""

from __future__ import annotations

import json
import math

import pytest

from scripts import compare_runs
from trainers.grpo.compare import (comparison_markdown, config_differences, labels_for, load_run, plot_comparison,
                                   window_means)
from trainers.grpo.config import load_train_config
from trainers.grpo.run_dir import SNAPSHOT, config_dict


def _write_run(path, rewards, overrides=None, snapshot=True, extra=None):
    path.mkdir(parents=True)
    with (path / "metrics.jsonl").open("w") as f:
        for step, r in enumerate(rewards, start=1):
            f.write(json.dumps({"step": step, "reward_mean": r, "is_ess": 0.9, **(extra or {})}) + "\n")
    if snapshot:
        over = {"run": {"out_dir": str(path)}, **(overrides or {})}
        cfg = load_train_config("configs/default.yaml", over)
        (path / SNAPSHOT).write_text(json.dumps(config_dict(cfg)))
    return path


def test_window_means_group_steps_and_skip_non_finite_values():
    rows = [{"step": s, "x": float(s)} for s in range(1, 8)]
    assert window_means(rows, "x", 3, 7) == [2.0, 5.0, 7.0]
    rows[6]["x"] = math.nan
    assert window_means(rows, "x", 3, 9) == [2.0, 5.0, None]  # step 7 NaN, 8-9 not logged
    assert window_means(rows, "y", 3, 7) == [None, None, None]
    with pytest.raises(ValueError, match="window"):
        window_means(rows, "x", 0, 7)


def test_load_run_sorts_steps_and_keeps_the_last_record_of_a_step(tmp_path):
    run = tmp_path / "a"
    run.mkdir()
    lines = [{"step": 2, "reward_mean": 0.5}, {"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    loaded = load_run(run)
    assert [r["step"] for r in loaded.rows] == [1, 2]
    assert loaded.rows[1]["reward_mean"] == 0.7
    assert loaded.label == "a" and loaded.config is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no metrics.jsonl"):
        load_run(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a folder"):
        load_run(tmp_path / "nowhere")


def test_config_differences_name_the_fields_that_differ(tmp_path):
    exact = load_run(_write_run(tmp_path / "exact", [0.1]))
    bf16 = load_run(_write_run(tmp_path / "bf16", [0.1], {"rollout": {"backend_options": {"weights": "bfloat16"}},
                                                         "run": {"out_dir": "x", "seed": 3}}))
    bare = load_run(_write_run(tmp_path / "bare", [0.1], snapshot=False))
    diffs = config_differences([exact, bf16, bare])
    assert diffs == ["bare: no config.json snapshot",
                     "rollout.backend_options.weights: exact='<absent>', bf16='bfloat16'",
                     "run.seed: exact=0, bf16=3"]  # out_dir differs too, and is left out
    assert config_differences([exact, exact]) == []


def test_markdown_tables_hold_the_windowed_means_per_run(tmp_path):
    a = load_run(_write_run(tmp_path / "a", [0.1, 0.3, 0.5, 0.7, 0.9]))
    b = load_run(_write_run(tmp_path / "b", [0.2, 0.2, 0.4]))
    text = comparison_markdown([a, b], ["reward_mean", "is_ess"], window=2)
    table = text.split("## mean reward")[1].split("##")[0]
    assert "| 1-2 | 0.200 | 0.200 |" in table
    assert "| 3-4 | 0.600 | 0.400 |" in table
    assert "| 5-5 | 0.900 | - |" in table  # b stopped at step 3
    assert "| all | 0.500 | 0.267 |" in table
    assert "- **b**: `" in text and "3 steps (last 3)" in text
    assert "Config differences: none" in text
    with pytest.raises(ValueError, match=r"metric\(s\) kl_k9 not in any run's metrics.jsonl; logged: is_ess, reward_mean"):
        comparison_markdown([a, b], ["reward_mean", "kl_k9"], window=2)


def test_labels_default_to_folder_names_and_must_match_the_runs(tmp_path):
    assert labels_for(["runs/exact", "runs/bf16"], None) == ["exact", "bf16"]
    assert labels_for(["x/run", "y/run"], None) == ["x/run", "y/run"]  # clashing names: the paths
    assert labels_for(["a", "b"], ["one", "two"]) == ["one", "two"]
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        labels_for(["a", "b"], ["one"])
    assert labels_for(["a", "b"], ["one", "one"]) == ["one", "one"]  # a group


def test_runs_sharing_a_label_are_one_setting_with_its_range(tmp_path):
    e0 = load_run(_write_run(tmp_path / "e0", [0.1, 0.3, 0.5, 0.7]), "exact")
    e1 = load_run(_write_run(tmp_path / "e1", [0.3, 0.5, 0.9, 0.9], {"run": {"seed": 1}}), "exact")
    e2 = load_run(_write_run(tmp_path / "e2", [0.2, 0.4], {"run": {"seed": 2}}), "exact")  # stopped at 2
    b0 = load_run(_write_run(tmp_path / "b0", [0.2, 0.2, 0.2, 0.2],
                             {"rollout": {"backend_options": {"weights": "bfloat16"}}}), "bf16")
    text = comparison_markdown([e0, e1, e2, b0], ["reward_mean"], window=2)
    assert "| steps | exact (3 runs: mean [min-max]) | bf16 |" in text
    assert "| 1-2 | 0.300 [0.200-0.400] | 0.200 |" in text
    assert "| 3-4 | 0.750 [0.600-0.900] | 0.200 |" in text  # e2 has no value there
    assert "- **exact (e1)**: `" in text and "- **bf16**: `" in text
    assert "- run.seed: exact (e0)=0, exact (e1)=1, exact (e2)=2, bf16=0" in text


def test_command_writes_the_table_and_the_figure(tmp_path, capsys):
    a = _write_run(tmp_path / "a", [0.1, 0.3], extra={"rollout_vs_trainer_logp_max": 3e-5})
    b = _write_run(tmp_path / "b", [0.2, 0.4], {"rollout": {"backend_options": {"weights": "bfloat16"}}},
                   extra={"rollout_vs_trainer_logp_max": 0.15})
    out = tmp_path / "cmp"
    rc = compare_runs.main([str(a), str(b), "--labels", "exact,bf16", "--window", "1", "--out", str(out),
                            "--metrics", "reward_mean,rollout_vs_trainer_logp_max"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| 2 | " not in printed and "| 2-2 | 0.300 | 0.400 |" in printed
    assert "| all | 3e-05 | 0.150 |" in printed
    assert (out / "comparison.md").read_text() in printed
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare_runs.main([str(a), "--metrics", "nope"]) == 2
    assert "nope not in any run" in capsys.readouterr().err
    assert compare_runs.main([str(a), "--window", "0"]) == 2
    assert "--window must be >= 1" in capsys.readouterr().err


def test_a_group_is_drawn_as_its_mean_with_a_band(tmp_path, monkeypatch):
    import matplotlib.axes

    runs = [load_run(_write_run(tmp_path / f"s{i}", [0.1 * i, 0.2 * i, 0.3 * i]), "exact") for i in (1, 2, 3)]
    runs.append(load_run(_write_run(tmp_path / "other", [0.5, 0.5, 0.5]), "bf16"))
    drawn = []
    plot, band = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.fill_between

    def record_plot(self, x, y, **kw):
        drawn.append(("line", kw["label"], list(y)))
        return plot(self, x, y, **kw)

    def record_band(self, x, lo, hi, **kw):
        drawn.append(("band", list(lo), list(hi)))
        return band(self, x, lo, hi, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record_plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", record_band)
    png = plot_comparison(runs, ["reward_mean"], tmp_path / "c.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert drawn[0][:2] == ("line", "exact (mean of 3)") and drawn[0][2] == pytest.approx([0.2, 0.4, 0.6])
    assert drawn[1][0] == "band"
    assert drawn[1][1] == pytest.approx([0.1, 0.2, 0.3]) and drawn[1][2] == pytest.approx([0.3, 0.6, 0.9])
    assert drawn[2] == ("line", "bf16", [0.5, 0.5, 0.5]) and len(drawn) == 3  # one run: no band
