"""``scripts/research/bench_amx.py``: what it measures and how it reports, on the tiny random model (the
figures themselves are measured by running the script on the embedded model). What must hold: the
two kernels alternate round by round (tiles first in even rounds), every step and call of a round
runs on its kernel's engine (``EngineOptions(amx=...)``, over the same target and head), the rows
keep both kernels' medians, the engine passed in keeps its options, and the script refuses (exit 2)
where the tiles cannot run."""

from __future__ import annotations

import pytest

from tests.scripts.bench_fixtures import tiny  # noqa: F401 (tiny: the fixture)


def test_kernels_alternate_and_rows_keep_each_kernels_medians(tiny, monkeypatch, capsys):
    from rollout.options import EngineOptions
    from scripts.research import bench_amx

    target, tok, engine = tiny
    seen, engines = [], set()
    step_costs, tok_per_s = bench_amx.step_costs, bench_amx.tok_per_s

    def timed_steps(eng, *a, **kw):
        seen.append(("steps", eng.options.amx))
        engines.add(eng)
        assert eng.target is target and eng.head is engine.head
        return step_costs(eng, *a, **kw)

    def timed_call(eng, prompts, spec, *a):
        seen.append((spec.mode, eng.options.amx))
        engines.add(eng)
        return tok_per_s(eng, prompts, spec, *a)

    monkeypatch.setattr(bench_amx, "step_costs", timed_steps)
    monkeypatch.setattr(bench_amx, "tok_per_s", timed_call)
    args = bench_amx.parse_args(["--batch-sizes", "1,2", "--blocks", "1,3", "--rounds", "3", "--reps", "1",
                                 "--max-new-tokens", "4", "--chain-k", "2"])
    rows = bench_amx.measure(engine, [[1, 20 + i, 300 + i] for i in range(2)], args)

    kernels = [amx for what, amx in seen if what == "steps"]
    assert kernels == [True, False, False, True, True, False] * 2  # tiles, compact; compact, tiles; ...
    for i in range(0, len(seen), 3):  # each kernel's steps, then its plain and chain calls, on one engine
        assert [w for w, _ in seen[i:i + 3]] == ["steps", "off", "chain"]
        assert len({amx for _, amx in seen[i:i + 3]}) == 1
    assert len(engines) == 2 and engine in engines  # the tiles' is the engine passed in (amx on)
    assert engine.options == EngineOptions()
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for kernel in bench_amx.KERNELS:
            assert sorted(row[kernel]["steps_ms"]) == ["1", "3", "draft"]
            assert all(ms > 0 for ms in row[kernel]["steps_ms"].values())
            assert sorted(row[kernel]["tok_s"]) == ["chain K=2", "plain"]
            assert all(v > 0 for v in row[kernel]["tok_s"].values())
    out = capsys.readouterr().out
    assert out.count("compact -> tiles: T(1)") == 2 and "chain K=2" in out and "over the same kernel's plain" in out


def test_report_puts_the_ratios_the_right_way_round(capsys):
    """Times: compact / tiles; tok/s: tiles / compact, and each row over its own kernel's plain row."""
    from scripts.research.bench_amx import report

    row = {"tiles": {"steps_ms": {"1": 10.0}, "tok_s": {"plain": 200.0, "chain K=3": 300.0}},
           "compact": {"steps_ms": {"1": 20.0}, "tok_s": {"plain": 100.0, "chain K=3": 120.0}}}
    report(8, row)
    out = capsys.readouterr().out
    assert "T(1) 20.0 -> 10.0 ms (2.00x)" in out
    assert "plain          100.0 ->   200.0 tok/s (2.00x)" in out
    assert "120.0 ->   300.0 tok/s (2.50x); over the same kernel's plain: 1.20x -> 1.50x" in out


def test_refuses_where_the_tiles_cannot_run(monkeypatch, capsys):
    from rollout.kernels import native_linear
    from scripts.research import bench_amx

    monkeypatch.setattr(native_linear, "amx_available", lambda: False)
    monkeypatch.setattr(bench_amx, "load_embedded_target", lambda: pytest.fail("loaded the model anyway"))
    assert bench_amx.main(["--batch-sizes", "1"]) == 2
    assert "AMX tiles cannot run here" in capsys.readouterr().err
