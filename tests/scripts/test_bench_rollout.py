"""The rollout benchmark's bookkeeping, on a tiny random model (the figures themselves are
measured by running the script on the embedded model); its rows on other engines and with
switches off are in ``test_bench_rollout_engines.py``."""

from __future__ import annotations

import pytest

from tests.scripts.bench_fixtures import drafting, tiny  # noqa: F401 (tiny: the fixture)


def test_every_row_reports_its_own_speed(tiny):
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "6", "--modes", "chain,tree",
                       "--verifiers", "lossless,mars,overshoot", "--tree", "2,2,4"])
    prompts = [[1, 20 + i, 300 + i] for i in range(4)]
    rows = measure(args, target, tok, engine, prompts, SamplingParams(max_new_tokens=6))
    keys = [(r["mode"], r["verifier"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 + 2 * 3  # HF, off, and 3 verifiers per speculative mode
    ar = next(r for r in rows if r["mode"] == "off")
    for r in rows:
        assert r["tokens"] > 0 and r["seconds"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        assert r["peak_rss_mb"] >= r["rss_mb"] > 0
        assert r["tau"] >= 1.0
        assert "step_emitted" not in r  # the rows' rounds are folded into tau_se, not dumped
    # tau's standard error over the 4 rows: none for HF, 0 for plain decoding (every round emits 1)
    assert next(r for r in rows if r["mode"] == "hf generate")["tau_se"] is None and ar["tau_se"] == 0.0
    spec = [r for r in rows if r["mode"] not in ("hf generate", "off")]
    assert all(0 <= r["tau_se"] < r["tau"] for r in spec) and any(r["tau_se"] > 0 for r in spec)


def test_tau_se_is_the_rows_error_over_every_call(tiny, monkeypatch):
    """A row's tau_se is ``tau_with_error`` over every row of every call of it (passes included)."""
    import scripts.bench_measure as bm
    from rollout.outputs import tau_with_error
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    seen = {}
    run_ours = bm.run_ours

    def spy(engine, group, sampling, spec, verifier, seed, backend=None):
        res = run_ours(engine, group, sampling, spec, verifier, seed, backend)
        seen.setdefault(spec.mode, []).extend(res["step_emitted"])
        return res

    monkeypatch.setattr(bm, "run_ours", spy)
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "8", "--modes", "chain", "--chain-k", "3",
                       "--verifiers", "lossless", "--passes", "2", "--no-hf", "--cost-reps", "0"])
    prompts = [[1, 20 + i, 300 + i] for i in range(4)]
    rows = measure(args, target, tok, engine, prompts, SamplingParams(max_new_tokens=8))
    chain = next(r for r in rows if r["mode"] != "off")
    assert len(seen["chain"]) == 8  # 4 prompts, 2 passes
    assert chain["tau_se"] == pytest.approx(tau_with_error(seen["chain"])[1])
    assert chain["tau"] == pytest.approx(tau_with_error(seen["chain"])[0])


def test_max_batch_values_make_separate_rows(tiny):
    """One row per max_batch; a numeric max_batch below the batch size has no bound (its plain
    rounds would enter tau while every round is charged the drafting), one at the batch size drafts
    in every round and has one."""
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "3", "--max-new-tokens", "5", "--modes", "chain", "--no-hf",
                       "--verifiers", "mars", "--max-batch", "none,1,3", "--cost-reps", "1"])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(3)],
                   SamplingParams(max_new_tokens=5))
    by_mode = {r["mode"]: r for r in rows}
    assert list(by_mode) == ["off", "chain K=3 sampled", "chain K=3 sampled mb=1", "chain K=3 sampled mb=3"]
    assert all(r["tokens"] == 15 for r in rows)
    assert by_mode["chain K=3 sampled"]["bound"] > 0 and by_mode["chain K=3 sampled mb=3"]["bound"] > 0
    below = by_mode["chain K=3 sampled mb=1"]
    assert below["bound"] is None and below["of_bound"] is None and below["call_bound"] is None


def test_the_bound_counts_the_tokens_kept_not_those_cut_after_a_stop_or_the_limit(tiny, monkeypatch):
    """tau (the acceptance) counts every token the verifier emitted, a row's last round past its
    stop token or token limit too; tau_kept, the bound's, only those the completions kept (each
    row's tokens after the prefill's first one), as tokens/s counts them."""
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    calls = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, sampling, spec, *a, **kw: calls.append(
        (spec.mode, generate(prompts, sampling, spec, *a, **kw))) or calls[-1][1])
    args = parse_args(["--batch-sizes", "4", "--max-new-tokens", "7", "--modes", "chain", "--chain-k", "6",
                       "--no-hf", "--verifiers", "overshoot", "--cost-reps", "1"])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(4)],
                   SamplingParams(max_new_tokens=7))
    chain = next(r for r in rows if r["mode"] != "off")
    done = [c for mode, res in calls if mode == "chain" for c in res.completions]
    rounds = sum(len(c.step_emitted) for c in done)
    assert chain["tau"] == pytest.approx(sum(sum(c.step_emitted) for c in done) / rounds)
    assert chain["tau_kept"] == pytest.approx(sum(len(c.completion_ids) - 1 for c in done) / rounds)
    assert chain["tau_kept"] < chain["tau"]  # 6 tokens after the first, up to 7 a round: the last round is cut
    costs = chain["step_costs_ms"]
    assert chain["bound"] == pytest.approx(chain["tau_kept"] * costs["1"] / (costs["7"] + drafting(costs, 6)))


def test_verifier_backends_run_side_by_side(tiny):
    """--verifier-backend native,torch: one row per backend; both run the same procedure on the
    same uniforms, so they emit the same tokens."""
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "6", "--modes", "chain,tree", "--no-hf",
                       "--verifiers", "mars", "--tree", "2,2,4", "--verifier-backend", "native,torch"])
    prompts = [[1, 20 + i, 300 + i] for i in range(4)]
    rows = measure(args, target, tok, engine, prompts, SamplingParams(max_new_tokens=6))
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"off", "chain K=3 sampled [native]", "chain K=3 sampled [torch]",
                            "tree d=2 k=2 n=4 [native]", "tree d=2 k=2 n=4 [torch]"}
    for mode in ("chain K=3 sampled", "tree d=2 k=2 n=4"):
        fast, slow = by_mode[f"{mode} [native]"], by_mode[f"{mode} [torch]"]
        assert fast["tokens"] == slow["tokens"] and fast["tau"] == slow["tau"]
        assert 0 < fast["verify_s"] < fast["seconds"]
    with pytest.raises(SystemExit, match="--verifier-backend"):
        measure(parse_args(["--batch-sizes", "2", "--verifier-backend", "cuda"]), target, tok, engine,
                prompts, SamplingParams(max_new_tokens=6))


def test_bound_is_tau_times_measured_step_costs(tiny):
    """Each fixed speculative row reports bound = tau x T(1) / (T(K+1) + drafting) from the step
    costs the script measured for that batch size (drafting: K x T_draft for a tree level by
    level, T_draft + T_chain(K) for a chain drafted in one C++ call); auto rows and plain rows
    have none."""
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "6", "--modes", "chain,tree", "--no-hf",
                       "--verifiers", "lossless", "--tree", "2,2,4", "--chain-k", "2,3", "--max-batch", "none,auto",
                       "--adaptive-k", "--cost-reps", "2"])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)],
                   SamplingParams(max_new_tokens=6))
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"off", "chain K=2 sampled", "chain K=3 sampled", "tree d=2 k=2 n=4",
                            "chain K=2 sampled mb=auto/k", "chain K=3 sampled mb=auto/k", "tree d=2 k=2 n=4 mb=auto"}
    costs = by_mode["off"]["step_costs_ms"]
    assert {"1", "3", "4", "5", "draft"} <= set(costs) <= {"1", "3", "4", "5", "draft", "chain2", "chain3"}
    assert all(v > 0 for v in costs.values())
    for k in (2, 3):
        r = by_mode[f"chain K={k} sampled"]
        assert r["bound"] == pytest.approx(r["tau_kept"] * costs["1"] / (costs[str(k + 1)] + drafting(costs, k)))
        assert r["of_bound"] == pytest.approx(r["speedup_vs_ar"] / r["bound"])
    tree = by_mode["tree d=2 k=2 n=4"]
    assert tree["bound"] == pytest.approx(tree["tau_kept"] * costs["1"] / (costs["5"] + 2 * costs["draft"]))
    ar = by_mode["off"]
    for r in rows:  # the decoding alone: each call's time after its setup (packing, prefill)
        assert 0 < r["setup_s"] < r["seconds"]
        assert r["decode_tokens_per_s"] == pytest.approx(r["tokens"] / (r["seconds"] - r["setup_s"]))
        assert r["decode_vs_ar"] == pytest.approx(r["decode_tokens_per_s"] / ar["decode_tokens_per_s"])
        if r["bound"]:
            assert r["decode_of_bound"] == pytest.approx(r["decode_vs_ar"] / r["bound"])
            # the whole-call ceiling: the row's own setup, its decoding at the bound, over AR's whole calls
            at_bound = r["tokens"] / (r["setup_s"] + r["tokens"] / (r["bound"] * ar["decode_tokens_per_s"]))
            assert r["call_bound"] == pytest.approx(at_bound / ar["tokens_per_s"])
        else:
            assert r["decode_of_bound"] is None and r["call_bound"] is None
        # completions per prompt and against the autoregressive mode's on the same prompts
        assert r["mean_length"] == pytest.approx(r["tokens"] / 2)
        assert r["length_vs_ar"] == pytest.approx(r["tokens"] / ar["tokens"])
    for mode in ("off", "chain K=3 sampled mb=auto/k", "tree d=2 k=2 n=4 mb=auto"):
        assert by_mode[mode]["bound"] is None and by_mode[mode]["of_bound"] is None


def test_configurations_rotate_and_step_costs_span_the_run(tiny, monkeypatch):
    """--order rotate (default): batch i of prompts starts at configuration i, so none always
    runs first or last; the step costs are timed on every batch of prompts, after its runs."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    from scripts.bench_rollout import measure, parse_args
    from scripts.bench_rows import describe

    target, tok, engine = tiny
    events = []
    run, costs = bench_measure.run_ours, bench_measure.step_costs
    monkeypatch.setattr(bench_measure, "run_ours",
                        lambda eng, group, s, spec, *a, **kw: events.append(describe(spec)) or run(eng, group, s, spec, *a, **kw))
    monkeypatch.setattr(bench_measure, "step_costs",
                        lambda eng, group, *a, **kw: events.append(("costs", group[0][1])) or costs(eng, group, *a, **kw))
    prompts = [[1, 20 + i, 300 + i] for i in range(3)]
    base = ["--batch-sizes", "1", "--max-new-tokens", "4", "--modes", "chain,tree", "--no-hf",
            "--verifiers", "lossless", "--tree", "2,2,4", "--cost-reps", "1"]
    rows = measure(parse_args(base), target, tok, engine, prompts, SamplingParams(max_new_tokens=4))
    names = ["off", "chain K=3 sampled", "tree d=2 k=2 n=4"]
    assert [r["mode"] for r in rows] == names  # reported in the listed order
    assert events == [*names, ("costs", 20), *names[1:], names[0], ("costs", 21),
                      names[2], *names[:2], ("costs", 22)]
    assert {"1", "4", "5", "draft"} <= set(rows[0]["step_costs_ms"]) <= {"1", "4", "5", "draft", "chain3"}
    events.clear()
    measure(parse_args([*base, "--order", "fixed", "--cost-reps", "0"]), target, tok, engine, prompts,
            SamplingParams(max_new_tokens=4))
    assert events == names * 3


def test_median_of_the_costs():
    from scripts.bench_measure import median, run_order

    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert run_order(4, 5, "rotate") == [1, 2, 3, 0] and run_order(4, 5, "fixed") == [0, 1, 2, 3]


def test_plan_warmup_runs_auto_configs_untimed_first(tiny, monkeypatch):
    """--plan-warmup N: each max_batch auto configuration runs N untimed calls (other seeds) on
    the first batch of prompts before the timed ones; other rows run only their timed calls."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    import scripts.bench_rollout as bench

    target, tok, engine = tiny
    calls = []
    real = bench_measure.run_ours

    def spy(engine, group, sampling, spec, verifier, seed, backend=None):
        calls.append((str(spec.max_batch) if spec.speculative else "off", seed))
        return real(engine, group, sampling, spec, verifier, seed, backend)

    monkeypatch.setattr(bench_measure, "run_ours", spy)
    args = bench.parse_args(["--batch-sizes", "2", "--max-new-tokens", "4", "--modes", "chain", "--no-hf",
                             "--verifiers", "lossless", "--max-batch", "none,auto", "--plan-warmup", "2",
                             "--cost-reps", "0"])
    rows = bench.measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(4)],
                         SamplingParams(max_new_tokens=4))
    assert calls[:2] == [("auto", 10_000), ("auto", 10_001)]
    assert sorted(calls[2:]) == sorted([(mb, i) for mb in ("off", "None", "auto") for i in (0, 1)])
    assert all(r["tokens"] == 16 for r in rows)  # the timed calls only: 2 batches x 2 rows x 4 tokens


def test_passes_and_paired_ratios(tiny, monkeypatch):
    """--passes 2 runs over the batches of prompts twice (new seeds); each row's paired ratio is
    the median of its calls' tokens/s over the autoregressive call's on the same prompts."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    import scripts.bench_rollout as bench

    target, tok, engine = tiny
    seen = []
    real = bench_measure.run_ours

    def spy(engine, group, sampling, spec, verifier, seed, backend=None):
        res = real(engine, group, sampling, spec, verifier, seed, backend)
        res["seconds"] = {"off": 1.0}.get(spec.mode, 0.5 + 0.1 * seed)  # chain: 2.0, 1.67, 1.43, 1.25x
        seen.append((spec.mode, seed, tuple(map(tuple, group))))
        return res

    monkeypatch.setattr(bench_measure, "run_ours", spy)
    args = bench.parse_args(["--batch-sizes", "2", "--max-new-tokens", "4", "--modes", "chain", "--no-hf",
                             "--verifiers", "lossless", "--passes", "2", "--cost-reps", "0"])
    prompts = [[1, 20 + i, 300 + i] for i in range(4)]
    rows = bench.measure(args, target, tok, engine, prompts, SamplingParams(max_new_tokens=4))
    assert sorted((m, s) for m, s, _ in seen) == sorted((m, s) for m in ("off", "chain") for s in range(4))
    assert {g for m, s, g in seen if s in (0, 2)} == {((1, 20, 300), (1, 21, 301))}  # pass 2: same prompts
    chain = next(r for r in rows if r["mode"] != "off")
    assert chain["paired_vs_ar"]["n"] == 4
    assert chain["paired_vs_ar"]["median"] == pytest.approx((1 / 0.6 + 1 / 0.7) / 2)
    assert chain["paired_vs_ar"]["min"] == pytest.approx(1 / 0.8) and chain["paired_vs_ar"]["max"] == pytest.approx(2.0)
    with pytest.raises(SystemExit, match="--passes"):
        bench.measure(bench.parse_args(["--batch-sizes", "2", "--passes", "0"]), target, tok, engine, prompts,
                      SamplingParams(max_new_tokens=4))


def test_verifiers_with_parameters_are_rows_of_their_own(tiny):
    """``--verifiers`` takes rule names (',') or specs with parameters (';'); each spec is a row
    labelled with its parameters, and a bad spec exits naming the flag."""
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args
    from scripts.bench_rows import parse_verifiers

    assert [(v.name, v.params) for v in parse_verifiers("lossless,mars")] == [("lossless", {}), ("mars", {})]
    specs = parse_verifiers("overshoot:lenience=0.5;overshoot:lenience=0.3,min_p=0.1; mars:theta=0.8")
    assert [(v.name, v.params) for v in specs] == [
        ("overshoot", {"lenience": 0.5}), ("overshoot", {"lenience": 0.3, "min_p": 0.1}), ("mars", {"theta": 0.8})]
    for bad in ("lossless,overshoot:lenience=0.3", "overshoot:lenience", "nope", "overshoot:lenience=2"):
        with pytest.raises(SystemExit, match="--verifiers"):
            parse_verifiers(bad)
    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "6", "--modes", "chain", "--no-hf", "--cost-reps", "0",
                       "--verifiers", "overshoot:lenience=1.0;overshoot:lenience=0.2"])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)], SamplingParams(max_new_tokens=6))
    by_verifier = {r["verifier"]: r for r in rows if r["mode"] != "off"}
    assert set(by_verifier) == {"overshoot:lenience=1", "overshoot:lenience=0.2"}
    assert all(r["tokens"] > 0 for r in by_verifier.values())


def test_law_test_rows_run_on_chains_only():
    """``mars:theta=0.9,test=law`` is a row of its own on chains; trees skip it (a sampled tree
    always verifies towards the law, a top-k tree cannot)."""
    from scripts.bench_rollout import parse_args
    from scripts.bench_rows import spec_configs

    args = parse_args(["--modes", "chain,tree", "--chain-k", "3", "--tree", "s4,2,5;3,4,8",
                       "--verifiers", "mars;mars:theta=0.9,test=law"])
    pairs = [(s.mode, s.tree_candidates if s.mode == "tree" else "", v.test) for s, v in spec_configs(args)]
    assert pairs == [("chain", "", "rule"), ("chain", "", "law"), ("tree", "sampled", "rule"), ("tree", "top_k", "rule")]


def test_sampled_trees_run_rows_with_their_own_draft_steps(tiny):
    """``--tree s4,2,5`` is a tree of sampled candidates: a row for each verifier, and its bound
    counts the shape's head steps."""
    from rollout.params import SamplingParams
    from rollout.engine.sampled_tree import draft_steps, sampled_shape
    from scripts.bench_rollout import measure, parse_args
    from scripts.bench_rows import spec_configs

    args = parse_args(["--batch-sizes", "1", "--max-new-tokens", "6", "--modes", "tree", "--no-hf",
                       "--verifiers", "lossless,mars", "--tree", "2,2,4;s4,2,5", "--cost-reps", "2"])
    pairs = [(s.tree_candidates, v.name) for s, v in spec_configs(args)]
    assert pairs == [("top_k", "lossless"), ("top_k", "mars"), ("sampled", "lossless"), ("sampled", "mars")]
    target, tok, engine = tiny
    rows = measure(args, target, tok, engine, [[1, 20, 300]], SamplingParams(max_new_tokens=6))
    row = next(r for r in rows if r["mode"] == "tree d=4 k=2 n=5 sampled")
    costs = row["step_costs_ms"]
    steps = draft_steps(sampled_shape(5, 4, 2))
    assert steps == 4 and row["tokens"] > 0
    assert row["bound"] == pytest.approx(row["tau_kept"] * costs["1"] / (costs["6"] + steps * costs["draft"]))


def test_output_folders_are_checked_before_the_run_and_the_columns_fit_the_labels(tmp_path, tiny, capsys):
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    with pytest.raises(SystemExit, match="--plot .*does not exist"):
        parse_args(["--plot", str(tmp_path / "no" / "speed.png")])
    with pytest.raises(SystemExit, match="--json .*does not exist"):
        parse_args(["--json", str(tmp_path / "no" / "run.json")])
    with pytest.raises(SystemExit, match="--planner-trace .*does not exist"):
        parse_args(["--planner-trace", str(tmp_path / "no" / "plans.json")])
    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "3", "--modes", "tree", "--tree", "s2,2,3",
                       "--max-batch", "auto", "--verifiers", "lossless;overshoot:lenience=0.5,min_p=0.1",
                       "--no-hf", "--plot", str(tmp_path / "speed.png")])
    measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)], SamplingParams(max_new_tokens=3))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("batch", "    2 "))]
    assert len(lines) == 4 and "tree d=2 k=2 n=3 sampled mb=auto" in lines[-1]
    col = lines[0].index("tok/s") + len("tok/s")  # right-aligned: every row's speed ends under the header
    assert all(ln[col - 1] != " " and ln[col] == " " for ln in lines[1:]), lines


def test_planner_trace_counts_each_auto_rows_rounds_per_batch_size(tiny, capsys):
    """``--planner-trace``: each ``max_batch: auto`` row carries its planner's rounds of that batch
    size (the second batch size's records follow the first's), their count by choice and reason,
    and a printed line; rows that do not plan have none. Without the flag nothing is recorded."""
    from rollout.engine.engine import Engine
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig
    from rollout.engine.planner import trace_summary
    from scripts.bench_rollout import measure, parse_args
    from scripts.bench_rows import plan_line

    target, tok, _ = tiny
    engine = Engine(target, tiny[2].head, num_threads=1)  # a fresh engine: no planner made yet
    sampling = SamplingParams(max_new_tokens=6)
    base = ["--max-new-tokens", "6", "--modes", "chain", "--no-hf", "--verifiers", "lossless",
            "--max-batch", "none,auto", "--cost-reps", "0"]
    prompts = [[1, 20 + i, 300 + i] for i in range(4)]
    rows = measure(parse_args(["--batch-sizes", "2,4", *base, "--planner-trace", "x.json"]), target, tok, engine,
                   prompts, sampling)
    auto = [r for r in rows if r["mode"].endswith("mb=auto")]
    assert [r["batch"] for r in auto] == [2, 4]
    assert all("planner" not in r for r in rows if r not in auto)
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto")
    whole = engine.plan_trace(spec, VerifierConfig(), sampling)
    assert auto[0]["planner_trace"] + auto[1]["planner_trace"] == whole
    assert {r["batch"] for r in auto[0]["planner_trace"]} <= {1, 2}
    assert max(r["batch"] for r in auto[1]["planner_trace"]) == 4
    for r in auto:
        assert r["planner"] == trace_summary(r["planner_trace"])
        assert r["planner"]["rounds"] == len(r["planner_trace"]) > 0
        assert sum(r["planner"]["plain"].values()) + sum(r["planner"]["draft"].values()) == r["planner"]["rounds"]
        # every token but each row's first (sampled with the prefill), before the length cut
        assert r["planner"]["tokens"]["draft"] + r["planner"]["tokens"]["plain"] >= r["tokens"] - len(prompts)
    out = capsys.readouterr().out
    assert plan_line(auto[0]) in out and plan_line(auto[1]) in out
    head = f"  planner, batch 2 {auto[0]['mode']} lossless: {auto[0]['planner']['rounds']} rounds; draft "
    assert plan_line(auto[0]).startswith(head)
    quiet = Engine(target, tiny[2].head, num_threads=1)
    rows = measure(parse_args(["--batch-sizes", "2", *base]), target, tok, quiet, prompts[:2], sampling)
    assert all("planner" not in r for r in rows) and quiet.plan_trace(spec, VerifierConfig(), sampling) is None
