"""The figures of ``scripts/bench_plot.py``: a run's speedups next to their bounds, and a planner
trace's rounds (from rows and files shaped like ``bench_rollout``'s; no models)."""

from __future__ import annotations

import pytest


def _bench_rows() -> list[dict]:
    """Rows as ``measure`` writes them: HF, our autoregressive mode, a chain with a bound, an
    ``auto`` row without one, and a second batch size."""
    base = {"tau": 1.0, "decode_vs_ar": None, "bound": None}
    return [{**base, "batch": 1, "mode": "hf generate", "verifier": "-", "speedup_vs_ar": 0.8},
            {**base, "batch": 1, "mode": "off", "verifier": "lossless", "speedup_vs_ar": 1.0, "decode_vs_ar": 1.0},
            {**base, "batch": 1, "mode": "chain K=4 sampled", "verifier": "mars:theta=0.9,test=law",
             "speedup_vs_ar": 1.55, "tau": 2.33, "decode_vs_ar": 1.67, "bound": 1.73, "call_bound": 1.62},
            {**base, "batch": 1, "mode": "chain K=3 sampled mb=auto", "verifier": "overshoot",
             "speedup_vs_ar": 1.4, "tau": 2.1, "decode_vs_ar": 1.5},
            {**base, "batch": 8, "mode": "off", "verifier": "lossless", "speedup_vs_ar": 1.0, "decode_vs_ar": 1.0},
            {**base, "batch": 8, "mode": "chain K=2 sampled", "verifier": "overshoot", "speedup_vs_ar": 1.12,
             "tau": 2.26, "decode_vs_ar": 1.2, "bound": 1.18}]


def test_plot_data_keeps_each_batch_size_in_run_order_and_leaves_out_hf():
    from scripts.bench_plot import plot_data

    data = plot_data(list(reversed(_bench_rows())))  # batch 8's rows first: panels still ascend
    assert list(data) == [1, 8]
    assert [d["label"] for d in data[1]] == ["chain K=3 sampled mb=auto  overshoot",
                                             "chain K=4 sampled  mars:theta=0.9,test=law", "off  lossless"]
    chain = data[1][1]
    assert (chain["speedup"], chain["decode"], chain["bound"], chain["call_bound"], chain["tau"]) == (
        1.55, 1.67, 1.73, 1.62, 2.33)
    assert data[8][1]["call_bound"] is None  # a row from a file written before call_bound existed
    assert data[1][0]["bound"] is None and [d["plain"] for d in data[8]] == [False, True]
    with pytest.raises(ValueError, match="no rows"):
        plot_data(_bench_rows()[:1])


def test_plot_is_written_from_a_run_and_from_its_json(tmp_path, capsys):
    import json

    from scripts.bench_plot import main, plot_rows

    out = plot_rows(_bench_rows(), tmp_path / "speed.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"args": {}, "results": _bench_rows()}))
    main([str(src)])
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG" and "wrote" in capsys.readouterr().out
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="neither a bench_rollout --json file"):
        main([str(bad)])
    with pytest.raises(SystemExit, match="cannot read"):
        main([str(tmp_path / "missing.json")])


def _plan_trace() -> list[dict]:
    """A --planner-trace file's entries: two rows, calls 0-1 and 3."""
    def rec(call, k, why, emitted=None):
        r = {"call": call, "round": 0, "batch": 2, "k": k, "why": why, "rates": {}}
        return r | ({"round_s": 0.02, "draft_s": 0.004 * k, "emitted": emitted, "catch_up": False} if emitted else {})
    return [{"batch": 2, "mode": "chain K=3 sampled mb=auto", "verifier": "lossless",
             "rounds": [rec(0, 0, "new bucket", [1, 1]), rec(0, 3, "new bucket", [4, 2]), rec(1, 3, "best", [3, 1]),
                        rec(1, 0, "re-probe", [1, 1]), rec(1, 3, "best")]},
            {"batch": 4, "mode": "chain K=3 sampled mb=auto", "verifier": "overshoot",
             "rounds": [rec(3, 0, "no clear gain", [1, 1, 1, 1])]}]


def test_plan_data_and_figure_from_a_planner_trace(tmp_path):
    import json

    from rollout.engine.planner import REASONS
    from scripts.bench_plot import REASON_COLOURS, main, plan_data, plot_plans

    assert set(REASON_COLOURS) == set(REASONS)  # every reason is drawn
    data = plan_data(_plan_trace())
    assert [d["label"] for d in data] == ["batch 2  chain K=3 sampled mb=auto  lossless",
                                          "batch 4  chain K=3 sampled mb=auto  overshoot"]
    first = data[0]
    assert first["k"] == [0, 3, 3, 0, 3] and first["why"][3] == "re-probe"
    assert first["tokens"] == [1.0, 3.0, 2.0, 1.0, None]  # per row; the last round not measured
    assert first["starts"] == [2] and first["plain"] == pytest.approx(0.4) and data[1]["starts"] == []
    with pytest.raises(ValueError, match="planner-trace entry"):
        plan_data([{"batch": 2, "mode": "x", "verifier": "y", "rounds": []}])
    with pytest.raises(ValueError, match="no traced rows"):
        plan_data([])
    out = plot_plans(_plan_trace(), tmp_path / "plans.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    src = tmp_path / "plans.json"
    src.write_text(json.dumps(_plan_trace()))
    main([str(src)])
    assert (tmp_path / "plans.png").stat().st_size > 1000
    src.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="neither a bench_rollout --json file"):
        main([str(src)])
    src.write_text(json.dumps([{"batch": 1}]))
    with pytest.raises(SystemExit, match="not a bench_rollout --planner-trace entry"):
        main([str(src)])
