"""The rollout benchmark's bookkeeping, on a tiny random model (the figures themselves are
measured by running the script on the embedded model)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_policy_dir, tiny_head_dir):
    from rollout.eagle3 import load_eagle3
    from rollout.engine import Engine
    from rollout.models import TargetConfig, load_target

    target, tok = load_target(TargetConfig(path=str(tiny_policy_dir)))
    head = load_eagle3(tiny_head_dir, target)
    return target, tok, Engine(target, head, num_threads=1)


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


def test_max_batch_values_make_separate_rows(tiny):
    from rollout.params import SamplingParams
    from scripts.bench_rollout import measure, parse_args

    target, tok, engine = tiny
    args = parse_args(["--batch-sizes", "3", "--max-new-tokens", "5", "--modes", "chain", "--no-hf",
                       "--verifiers", "mars", "--max-batch", "none,1"])
    rows = measure(args, target, tok, engine, [[1, 20 + i, 300 + i] for i in range(3)],
                   SamplingParams(max_new_tokens=5))
    assert [r["mode"] for r in rows] == ["off", "chain K=3 sampled", "chain K=3 sampled mb=1"]
    assert all(r["tokens"] == 15 for r in rows)


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
