"""Rollout throughput inside TRL: TRL's own generation vs our rollouts, side by side.

    python -m scripts.bench_trl --config configs/trl.yaml [--rounds 3] [--json OUT.json]

Builds the run's trainers once (TRL's GRPOTrainer with its own generation, and
SpeculativeGRPOTrainer with our rollouts) and times TRL's ``_generate`` on the same
prompts (the config's prompts_per_step x num_generations, chat template, T and length)
for each configuration, interleaved round by round so that load on a shared machine hits
every column alike. Columns: TRL's own generation; ours with lossless chain, MARS chain
(the config's verifier params when it is MARS) and plain decoding (spec off). Reports
median tokens/s and the ratio to TRL's own generation.
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
    return {
        "trl_own": None,
        "ours_lossless_chain": replace(settings, verifier=VerifierConfig("lossless")),
        "ours_mars_chain": replace(settings, verifier=mars),
        "ours_plain": replace(settings, spec=SpecConfig(mode="off"), verifier=VerifierConfig("lossless")),
    }


def time_generate(trainer, prompts) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = trainer._generate(prompts)
    return time.perf_counter() - t0, sum(len(c) for c in out[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the per-round timings here")
    args = ap.parse_args(argv)
    from trainers.trl.config import load_trl_config

    try:
        trl_cfg = load_trl_config(args.config, {"run": {"generation": "trl"},  # TRL's generation: no head to train
                                                "rollout": {"drafter_training": {"every": 0}}})
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from trainers.trl.run import build_dataset, build_trainer

    baseline = build_trainer(trl_cfg)
    ours = build_trainer(replace(trl_cfg, run=replace(trl_cfg.run, generation="ours")))
    rows = build_dataset(trl_cfg)
    n_gen = baseline.num_generations
    prompts = [rows[i // n_gen]["prompt"] for i in range(trl_cfg.task.prompts_per_step * n_gen)]
    columns = configs(trl_cfg.settings())
    results: dict[str, list[dict]] = {name: [] for name in columns}
    for r in range(args.rounds):
        for name, settings in columns.items():
            trainer = baseline if settings is None else ours
            if settings is not None:
                ours.rollouts.settings = settings
            torch.manual_seed(r)
            seconds, tokens = time_generate(trainer, prompts)
            tau = ours.rollouts.last_batch.tau if settings is not None else 1.0
            results[name].append({"round": r, "seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
                                  "tau": tau})
            print(f"round {r + 1}/{args.rounds}  {name:20s} {tokens:5d} tokens  {seconds:7.1f} s  "
                  f"{tokens / seconds:6.1f} tok/s  tau {tau:.2f}", flush=True)
    base = statistics.median(x["tok_per_s"] for x in results["trl_own"])
    print(f"\n{len(prompts)} completions per call, max {trl_cfg.trl.get('max_completion_length')} tokens, "
          f"T = {trl_cfg.trl.get('temperature', 1.0)}, {args.rounds} interleaved rounds (medians)\n")
    print("| generation | tok/s | x TRL's own | tau | tokens per call |\n|---|---|---|---|---|")
    for name, xs in results.items():
        tps = statistics.median(x["tok_per_s"] for x in xs)
        print(f"| {name} | {tps:.1f} | {tps / base:.2f} | {statistics.median(x['tau'] for x in xs):.2f} | "
              f"{statistics.median(x['tokens'] for x in xs):.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
