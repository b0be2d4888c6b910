"""The rollout benchmark's rows on other engines and with the default engine's switches off
(``--unfused``, ``--fp32-head``, ``--no-amx``, ``--bf16-weights``, ``--int8-head``, ``--draft-steps``), on a
tiny random model (the figures themselves are measured by running the script on the embedded
model)."""

from __future__ import annotations

import pytest

from tests.rollout.bench_fixtures import drafting, tiny  # noqa: F401 (tiny: the fixture)


def _rows_with_switch_seen(tiny, monkeypatch, owner, name: str, flags: list[str]):
    """Run the bench with ``flags`` on 2 prompts of 5 tokens, recording ``owner.name`` as each
    call of ours starts: (rows, the values seen)."""
    from rollout.params import SamplingParams
    from scripts import bench_measure
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    seen = []
    run = bench_measure.run_ours
    monkeypatch.setattr(bench_measure, "run_ours", lambda *a, **kw: seen.append(getattr(owner, name)) or run(*a, **kw))
    args = parse_args(["--batch-sizes", "2", "--max-new-tokens", "5", "--modes", "chain", "--no-hf",
                       "--verifiers", "lossless", *flags])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(2)],
                   SamplingParams(max_new_tokens=5))
    return rows, seen


def test_unfused_row_runs_the_modules_own_forwards(tiny, monkeypatch):
    """--unfused: a row of our autoregressive mode with rollout.fused_layers off, then back on."""
    from rollout import fused_layers

    rows, seen = _rows_with_switch_seen(tiny, monkeypatch, fused_layers, "enabled", ["--unfused"])
    assert [r["mode"] for r in rows] == ["off", "off [unfused layers]", "chain K=3 sampled"]
    assert seen == [True, False, True] and fused_layers.enabled
    assert rows[0]["tokens"] == rows[1]["tokens"] == 10


def test_fp32_head_rows_pack_the_head_as_fp32_and_have_no_bound(tiny, monkeypatch):
    """--fp32-head: each speculative configuration again with native_linear.compact off (back on
    after), without a bound (the step costs are timed with compact panels)."""
    from rollout import native_linear

    rows, seen = _rows_with_switch_seen(tiny, monkeypatch, native_linear, "compact",
                                        ["--fp32-head", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [fp32 head]"]
    assert seen == [True, True, False] and native_linear.compact
    assert rows[1]["bound"] is not None and rows[2]["bound"] is None and rows[2]["of_bound"] is None


def test_no_amx_rows_turn_the_tiles_off_and_have_no_bound(tiny, monkeypatch):
    """--no-amx: each speculative configuration again with native_linear.amx off (back on after),
    without a bound (the step costs are timed with the tiles where the CPU has them)."""
    from rollout import native_linear

    rows, seen = _rows_with_switch_seen(tiny, monkeypatch, native_linear, "amx", ["--no-amx", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [no AMX]"]
    assert seen == [True, True, False] and native_linear.amx
    assert rows[1]["bound"] is not None and rows[2]["bound"] is None and rows[2]["of_bound"] is None


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
    from rollout import native_linear
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
    """--draft-steps: each speculative configuration again with native_draft.chains off (back on
    after): the same tokens (the same draws), no bound."""
    from rollout import native_draft

    rows, seen = _rows_with_switch_seen(tiny, monkeypatch, native_draft, "chains", ["--draft-steps", "--order", "fixed"])
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled [draft steps]"]
    assert seen == [True, True, False] and native_draft.chains
    assert rows[2]["bound"] is None and rows[1]["tokens"] == rows[2]["tokens"]
