"""The rollout benchmark's rows on other engines and with some of the engine's options off
(``--unfused``, ``--fp32-head``, ``--no-amx``, ``--bf16-weights``, ``--int8-head``, ``--draft-steps``), on a
tiny random model (the figures themselves are measured by running the script on the embedded
model)."""

from __future__ import annotations

import pytest

from tests.scripts.bench_fixtures import drafting, tiny  # noqa: F401 (tiny: the fixture)


def _rows_with_options_seen(tiny, monkeypatch, flags: list[str]):
    """Run the bench with ``flags`` on 2 prompts of 5 tokens, recording the engine each call of ours
    runs on: (rows, those engines)."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    ran = []
    run = bench_measure.run_ours
    monkeypatch.setattr(bench_measure, "run_ours", lambda eng, *a, **kw: ran.append(eng) or run(eng, *a, **kw))
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "5", "--modes", "chain", "--no-hf",
                       "--verifiers", "lossless", *flags])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)],
                   SamplingParams(max_new_tokens=5))
    for eng in ran:  # every row on the default engine's target and head, the default engine's own or not
        assert eng.target is target and eng.head is engine.head
    assert engine.options == type(engine.options)()  # the default engine keeps its options
    return rows, ran


def test_unfused_row_runs_the_modules_own_forwards(tiny, monkeypatch):
    """--unfused: a row of our autoregressive mode on an engine with ``EngineOptions(fused=False)``."""
    from rollout.options import EngineOptions

    _, _, engine = tiny
    rows, ran = _rows_with_options_seen(tiny, monkeypatch, ["--unfused"])
    assert [r["mode"] for r in rows] == ["off", "off [fused off]", "chain K=3 sampled"]
    assert ran[0] is ran[2] is engine and ran[1].options == EngineOptions(fused=False)
    assert rows[0]["tokens"] == rows[1]["tokens"] == 10


def test_fp32_head_rows_pack_the_head_as_fp32_and_have_no_bound(tiny, monkeypatch):
    """--fp32-head: each speculative configuration again with ``EngineOptions(compact_panels=False)``,
    without a bound (the step costs are timed with compact panels)."""
    from rollout.options import EngineOptions

    _, _, engine = tiny
    rows, ran = _rows_with_options_seen(tiny, monkeypatch, ["--fp32-head", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [compact_panels off]"]
    assert ran[:2] == [engine, engine] and ran[2].options == EngineOptions(compact_panels=False)
    assert rows[1]["bound"] is not None and rows[2]["bound"] is None and rows[2]["of_bound"] is None


def test_no_amx_rows_turn_the_tiles_off_and_have_no_bound(tiny, monkeypatch):
    """--no-amx: each speculative configuration again with ``EngineOptions(amx=False)``, without a
    bound (the step costs are timed with the tiles where the CPU has them)."""
    from rollout.options import EngineOptions

    _, _, engine = tiny
    rows, ran = _rows_with_options_seen(tiny, monkeypatch, ["--no-amx", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [amx off]"]
    assert ran[:2] == [engine, engine] and ran[2].options == EngineOptions(amx=False)
    assert rows[1]["bound"] is not None and rows[2]["bound"] is None and rows[2]["of_bound"] is None


def test_option_rows_share_one_engine_per_options_across_batch_sizes(tiny, monkeypatch):
    """Every flag's rows at once: each row's label names its options off, and the rows of one set of
    options run on one engine, kept from batch size to batch size (its planners go on learning)."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    ran = []
    run = bench_measure.run_ours
    monkeypatch.setattr(bench_measure, "run_ours", lambda eng, *a, **kw: ran.append(eng) or run(eng, *a, **kw))
    flags = ["--unshared-prefill", "--unfused", "--python-layers", "--python-draft", "--draft-steps", "--fp32-head",
             "--no-amx"]
    args = parse_args(["--batch-sizes", "1,2", "--max-new-tokens", "3", "--modes", "chain", "--no-hf",
                       "--verifiers", "lossless", "--order", "fixed", "--cost-reps", "0", *flags])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)],
                   SamplingParams(max_new_tokens=3))
    labels = ["off", "off [share_prompts off]", "off [fused off]", "chain K=3 sampled", "off [native_layers off]",
              "chain K=3 sampled [native_layers off]", "chain K=3 sampled [native_draft off]",
              "chain K=3 sampled [draft_chains off]", "chain K=3 sampled [compact_panels off]",
              "chain K=3 sampled [amx off]"]
    assert [r["mode"] for r in rows] == labels * 2
    assert len(ran) == 3 * len(labels)  # size 1: two batches of prompts; size 2: one; in the listed order
    for i, eng in enumerate(ran):
        label, off = labels[i % len(labels)], eng.options.describe()
        assert eng is ran[i % len(labels)]  # one engine per row, kept across batches and sizes
        assert label.endswith(f" [{off}]") if off else eng is engine


def test_bf16_weight_rows_run_on_a_rounded_copy_with_their_own_bound(tiny, tiny_policy_dir, tiny_head_dir,
                                                                     monkeypatch):
    """--bf16-weights: the autoregressive mode and each speculative configuration again, on a
    second engine over a target copy rounded to bf16 values; their bound is tau x T(1) of the
    exact autoregressive mode over that engine's own T(K+1) and drafting."""
    import torch

    from rollout.models import TargetConfig, load_target
    from rollout.params import SamplingParams
    from scripts import bench_measure, bench_rows
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    copy, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    monkeypatch.setattr(bench_rows, "load_embedded_target", lambda: (copy, tok))
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "5", "--modes", "chain", "--no-hf", "--verifiers",
                       "lossless", "--bf16-weights", "--cost-reps", "2", "--order", "fixed", "--head", str(tiny_head_dir)])
    args.rounded = bench_rows.rounded_engine(args, 1)
    assert args.rounded.target is copy and copy is not target
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in copy.model.parameters())
    assert not all(torch.equal(p, p.to(torch.bfloat16).float()) for p in target.model.parameters())
    ran = []
    run = bench_measure.run_ours
    monkeypatch.setattr(bench_measure, "run_ours", lambda eng, *a, **kw: ran.append(eng) or run(eng, *a, **kw))
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)], SamplingParams(max_new_tokens=5))
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "off [bf16 weights]", "chain K=3 sampled [bf16 weights]"]
    assert ran == [engine, engine, args.rounded, args.rounded]
    exact, own = rows[1]["step_costs_ms"], rows[3]["step_costs_ms"]
    assert rows[2]["step_costs_ms"] == own != exact
    assert rows[1]["bound"] == pytest.approx(rows[1]["tau"] * exact["1"] / (exact["4"] + drafting(exact, 3)))
    assert rows[3]["bound"] == pytest.approx(rows[3]["tau"] * exact["1"] / (own["4"] + drafting(own, 3)))
    assert rows[3]["speedup_vs_ar"] == pytest.approx(rows[3]["tokens_per_s"] / rows[0]["tokens_per_s"])


def test_int8_head_rows_run_on_a_rounded_head_with_their_own_bound(tiny, tiny_head_dir, monkeypatch):
    """--int8-head: each speculative configuration again, on a second engine over the same target
    with a head copy rounded to int8 weights; its bound uses that engine's own step costs."""
    from rollout.kernels import native_linear
    from rollout.params import SamplingParams
    from scripts import bench_measure, bench_rows
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "5", "--modes", "chain", "--no-hf", "--verifiers",
                       "lossless", "--int8-head", "--cost-reps", "2", "--order", "fixed", "--head", str(tiny_head_dir)])
    args.int8 = bench_rows.int8_engine(args, target, 1)
    assert args.int8.target is target and args.int8.head is not engine.head
    assert native_linear.int8_scales(args.int8.head.lm_head.weight) is not None
    assert native_linear.int8_scales(engine.head.lm_head.weight) is None
    ran = []
    run = bench_measure.run_ours
    monkeypatch.setattr(bench_measure, "run_ours", lambda eng, *a, **kw: ran.append(eng) or run(eng, *a, **kw))
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)], SamplingParams(max_new_tokens=5))
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [int8 head]"]
    assert ran == [engine, engine, args.int8]
    exact, own = rows[1]["step_costs_ms"], rows[2]["step_costs_ms"]
    assert own != exact
    assert rows[2]["bound"] == pytest.approx(rows[2]["tau"] * exact["1"] / (own["4"] + drafting(own, 3)))


def test_draft_steps_rows_switch_the_one_call_chain_off(tiny, monkeypatch):
    """--draft-steps: each speculative configuration again with ``EngineOptions(draft_chains=False)``:
    the same tokens (the same draws), no bound."""
    from rollout.options import EngineOptions

    _, _, engine = tiny
    rows, ran = _rows_with_options_seen(tiny, monkeypatch, ["--draft-steps", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [draft_chains off]"]
    assert ran[:2] == [engine, engine] and ran[2].options == EngineOptions(draft_chains=False)
    assert rows[2]["bound"] is None and rows[1]["tokens"] == rows[2]["tokens"]
