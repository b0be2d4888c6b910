"""Rollout throughput inside TRL: TRL's own generation vs our rollouts, side by side.

    python -m scripts.research.bench_trl --config configs/trl.yaml [--rounds 3] [--json OUT.json]
        [--prompts-per-step P] [--num-generations G] [--max-completion-length T] [--no-trl-own]
        [--columns ours_plain,ours_lossless_spec,...]

Builds the run's trainers once (TRL's GRPOTrainer with its own generation, and
SpeculativeGRPOTrainer with our rollouts) and times TRL's ``_generate`` on the same
prompts (the config's prompts_per_step x num_generations, or the flags', chat template, T
and length) for each configuration, interleaved round by round so that load on a shared
machine hits every column alike. Columns: TRL's own generation (``--no-trl-own`` leaves it
out); ours with plain decoding (spec off), and lossless and MARS (the config's verifier
params when it is MARS) with the config's speculation (``_spec``: with ``max_batch: auto``
the engine decides per round whether to draft) and with a chain drafting every round
(``_chain``: ``max_batch: null``, no adaptive K). Reports median tokens/s, the ratios to
TRL's own generation and to our plain decoding (the median of the per-round ratios, each
measured side by side, with its 90% bootstrap interval from 5 rounds on), tau and the share of
rounds that drafted. ``--trace FILE`` keeps the round planner's records of the ``max_batch: auto``
columns (why each round drafted or not, the rates it compared, what the round took).
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

from rollout.config import ConfigError  # noqa: E402


def configs(settings) -> dict:
    """Column name -> rollout settings (None: TRL's own generation)."""
    from rollout.params import SpecConfig, VerifierConfig

    mars = settings.verifier if settings.verifier.name == "mars" else VerifierConfig("mars", {"theta": 0.9})
    lossless = VerifierConfig("lossless")
    spec = settings.spec if settings.spec.mode != "off" else type(settings)().spec  # the plug-in's default
    chain = SpecConfig(mode="chain", num_draft_tokens=spec.num_draft_tokens, draft_sampling=spec.draft_sampling)
    return {
        "trl_own": None,
        "ours_plain": replace(settings, spec=SpecConfig(mode="off"), verifier=lossless),
        "ours_lossless_spec": replace(settings, spec=spec, verifier=lossless),
        "ours_mars_spec": replace(settings, spec=spec, verifier=mars),
        "ours_lossless_chain": replace(settings, spec=chain, verifier=lossless),
        "ours_mars_chain": replace(settings, spec=chain, verifier=mars),
    }


def median_interval(values: list[float], level: float = 0.9, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval (percentile, ``level``) of the median of ``values``: resampled with
    replacement ``draws`` times from a seeded generator."""
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1.0 - level) / 2
    return meds[int(tail * draws)], meds[min(draws - 1, int((1.0 - tail) * draws))]


def time_generate(trainer, prompts) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = trainer._generate(prompts)
    return time.perf_counter() - t0, sum(len(c) for c in out[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, help="override task.prompts_per_step")
    ap.add_argument("--num-generations", type=int, help="override trl.num_generations")
    ap.add_argument("--max-completion-length", type=int, help="override trl.max_completion_length")
    ap.add_argument("--no-trl-own", action="store_true", help="leave out TRL's own generation (the slowest column)")
    ap.add_argument("--columns", help="comma-separated columns to run (default: all)")
    ap.add_argument("--json", help="write the per-round timings here")
    ap.add_argument("--trace", help="write the round planner's records (choice, reason, rates compared, "
                    "measured seconds) of the max_batch: auto columns here, as JSON")
    args = ap.parse_args(argv)
    from trainers.trl.config import load_trl_config

    trl = {k: v for k, v in (("num_generations", args.num_generations),
                             ("max_completion_length", args.max_completion_length)) if v is not None}
    task = {"prompts_per_step": args.prompts_per_step} if args.prompts_per_step is not None else {}
    try:
        trl_cfg = load_trl_config(args.config, {"run": {"generation": "trl"},  # TRL's generation: no head to train
                                                "rollout": {"drafter_training": {"every": 0}}, "trl": trl,
                                                "task": task})
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from trainers.trl.run import build_dataset, build_trainer

    columns = configs(trl_cfg.settings())
    if args.columns:
        unknown = sorted(set(args.columns.split(",")) - set(columns))
        if unknown:
            print(f"error: unknown column(s) {unknown} (allowed: {', '.join(columns)})", file=sys.stderr)
            return 2
        columns = {name: settings for name, settings in columns.items() if name in args.columns.split(",")}
    if args.no_trl_own:
        columns.pop("trl_own", None)
    baseline = build_trainer(trl_cfg) if "trl_own" in columns else None
    ours = build_trainer(replace(trl_cfg, run=replace(trl_cfg.run, generation="ours")))
    rows = build_dataset(trl_cfg)
    n_gen = ours.num_generations
    prompts = [rows[i // n_gen]["prompt"] for i in range(trl_cfg.task.prompts_per_step * n_gen)]
    results: dict[str, list[dict]] = {name: [] for name in columns}
    if args.trace:
        ours.rollouts.backend.engine.trace_plans(True)
    names = list(columns)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each column in each position in turn
            settings = columns[name]
            trainer = baseline if settings is None else ours
            if settings is not None:
                ours.rollouts.settings = settings
            torch.manual_seed(r)
            seconds, tokens = time_generate(trainer, prompts)
            timings = ours.rollouts.last_batch.timings if settings is not None else {}
            tau = ours.rollouts.last_batch.tau if settings is not None else 1.0
            drafted = 1 - timings.get("plain_rounds", 0) / max(timings.get("rounds", 0), 1) \
                if settings is not None and settings.spec.speculative else 0.0
            results[name].append({"round": r, "seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
                                  "tau": tau, "drafted_rounds": drafted})
            print(f"round {r + 1}/{args.rounds}  {name:20s} {tokens:5d} tokens  {seconds:7.1f} s  "
                  f"{tokens / seconds:6.1f} tok/s  tau {tau:.2f}  drafted {drafted:.0%} of rounds", flush=True)

    def ratio(name: str, base: str) -> str:  # the median of the rounds' ratios, each measured side by side
        if base not in results:
            return "-"
        ratios = [x["tok_per_s"] / b["tok_per_s"] for x, b in zip(results[name], results[base])]
        if name == base or len(ratios) < 5:
            return f"{statistics.median(ratios):.2f}"
        lo, hi = median_interval(ratios)
        return f"{statistics.median(ratios):.2f} [{lo:.2f}-{hi:.2f}]"

    print(f"\n{len(prompts)} completions per call, max {trl_cfg.trl.get('max_completion_length')} tokens, "
          f"T = {trl_cfg.trl.get('temperature', 1.0)}, {args.rounds} interleaved rounds (medians), "
          f"speculation {trl_cfg.settings().spec}\n")
    print("| generation | tok/s | x TRL's own | x ours plain | tau | drafted rounds | tokens per call |\n"
          "|---|---|---|---|---|---|---|")
    for name, xs in results.items():
        tps = statistics.median(x["tok_per_s"] for x in xs)
        print(f"| {name} | {tps:.1f} | {ratio(name, 'trl_own')} | {ratio(name, 'ours_plain')} | "
              f"{statistics.median(x['tau'] for x in xs):.2f} | "
              f"{statistics.median(x['drafted_rounds'] for x in xs):.0%} | "
              f"{statistics.median(x['tokens'] for x in xs):.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.trace:
        write_traces(args.trace, ours, columns)
    return 0

def write_traces(path: str, ours, columns: dict) -> None:
    """The planner records of each column that plans its rounds, and their summary per column."""
    from rollout.engine.planner_trace import trace_summary

    engine = ours.rollouts.backend.engine
    traces = {name: engine.plan_trace(s.spec, s.verifier, ours.rollouts.sampling) for name, s in columns.items()
              if s is not None and s.spec.auto}
    traces = {name: t for name, t in traces.items() if t is not None}
    for name, trace in traces.items():
        print(f"planner, {name}: {trace_summary(trace)}", flush=True)
    with open(path, "w") as f:
        json.dump(traces, f)


if __name__ == "__main__":
    sys.exit(main())
