"""AMX tiles against compact bf16 panels for the rollout copy rounded to bf16, side by side.

    python -m scripts.research.bench_amx [--batch-sizes 1,8,16,32] [--blocks 1,3,7] [--rounds 3] [--reps 10]
                                [--max-new-tokens 64] [--chain-k 3] [--threads 2] [--json OUT.json]

The target is the embedded SmolLM2-135M-Instruct with its weights rounded to bf16 values, as the
hf backend's ``weights: bfloat16`` makes its rollout copy, and the shipped head (stored in bf16).
Both are bf16-valued, so the decoding kernel can pack them as AMX tiles (``csrc/amx.cpp``, where
the CPU has AMX-BF16) or as compact bf16 panels (``csrc/linear.cpp``, widened to fp32 FMAs); the
script runs an engine of each (``EngineOptions(amx=True)`` and ``amx=False``, over the same target
and head) alternately, ``--rounds`` times, and prints
for each batch size:
- ``T(n)``: the target's forward over n block tokens per row (``rollout.engine.timing.step_costs``,
  median of ``--reps``; n = 1 is a plain step, n = K + 1 a chain's verify block) and one draft step;
- tok/s of whole generate calls over ``batch`` held-out prompts (``--max-new-tokens``, T = 1):
  plain decoding and a lossless chain of ``--chain-k`` drafts, each the median of its rounds,
  and the speculative row over the same kernel's plain row;
- the ratio of the two kernels (compact / tiles for times, tiles / compact for tok/s).
Refuses to run (exit 2) where the tiles cannot run.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from rollout.eagle3 import default_head_path, load_eagle3  # noqa: E402
from rollout.engine.engine import Engine  # noqa: E402
from rollout.engine.timing import step_costs  # noqa: E402
from rollout.kernels import native_linear  # noqa: E402
from rollout.models import load_embedded_target, round_weights_  # noqa: E402
from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402
from scripts.cli import positive_int, positive_ints  # noqa: E402
from trainers.tasks.general import benchmark_prompts  # noqa: E402

KERNELS = ("tiles", "compact")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=positive_ints, default=[1, 8, 16, 32])
    ap.add_argument("--blocks", type=positive_ints, default=[1, 3, 7], help="block tokens per row of the timed forwards")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternations of the two kernels")
    ap.add_argument("--reps", type=positive_int, default=10, help="timed forwards per step and round")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--chain-k", type=positive_int, default=3)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", default=None, help="write every measurement here")
    return ap.parse_args(argv)


def engines(engine: Engine) -> dict[str, Engine]:
    """Each kernel's engine over ``engine``'s target and head: ``tiles`` with ``EngineOptions.amx``
    on, ``compact`` with it off (``engine`` itself for the one its options already choose)."""
    out = {}
    for kernel in KERNELS:
        options = dataclasses.replace(engine.options, amx=kernel == "tiles")
        out[kernel] = engine if options == engine.options else Engine(
            engine.target, engine.head, num_threads=torch.get_num_threads(), prefill_tokens=engine.prefill_tokens,
            options=options)
    return out


def tok_per_s(engine: Engine, prompts: list[list[int]], spec: SpecConfig, max_new: int, seed: int) -> float:
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new), spec=spec,
                          verifier=VerifierConfig(name="lossless"), seed=seed)
    return sum(len(c.completion_ids) for c in out.completions) / (time.perf_counter() - t0)


def measure(engine: Engine, prompts: list[list[int]], args) -> dict:
    specs = {"plain": SpecConfig(mode="off"), f"chain K={args.chain_k}": SpecConfig(mode="chain",
                                                                                    num_draft_tokens=args.chain_k)}
    rows: dict = {}
    on = engines(engine)
    for batch in args.batch_sizes:
        group = prompts[:batch]
        rec = {k: {"steps": [], "tok_s": {name: [] for name in specs}} for k in KERNELS}
        for r in range(args.rounds):
            for kernel in (KERNELS if r % 2 == 0 else KERNELS[::-1]):
                rec[kernel]["steps"].append(step_costs(on[kernel], group, args.blocks, args.reps))
                for name, spec in specs.items():
                    rec[kernel]["tok_s"][name].append(tok_per_s(on[kernel], group, spec, args.max_new_tokens,
                                                                args.seed + r))
            print(f"  batch {batch}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        rows[batch] = {k: {"steps_ms": {str(n): 1e3 * statistics.median(s[n] for s in rec[k]["steps"])
                                        for n in [*args.blocks, "draft"]},
                           "tok_s": {name: statistics.median(v) for name, v in rec[k]["tok_s"].items()}}
                       for k in KERNELS}
        report(batch, rows[batch])
    return rows


def report(batch: int, row: dict) -> None:
    tiles, compact = row["tiles"], row["compact"]
    steps = "  ".join(f"T({n}) {compact['steps_ms'][n]:.1f} -> {tiles['steps_ms'][n]:.1f} ms "
                      f"({compact['steps_ms'][n] / tiles['steps_ms'][n]:.2f}x)" for n in tiles["steps_ms"])
    print(f"batch {batch:3d}  compact -> tiles: {steps}")
    plain = {k: row[k]["tok_s"]["plain"] for k in KERNELS}
    for name in tiles["tok_s"]:
        c, t = compact["tok_s"][name], tiles["tok_s"][name]
        print(f"           {name:12s} {c:7.1f} -> {t:7.1f} tok/s ({t / c:.2f}x); over the same kernel's plain: "
              f"{c / plain['compact']:.2f}x -> {t / plain['tiles']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (native_linear.available() and native_linear.amx_available()):
        print("bench_amx: AMX tiles cannot run here (they need an AMX-BF16 CPU, the native library and "
              "HONEST_ROLLOUTS_AMX != 0)", file=sys.stderr)
        return 2
    target, tok = load_embedded_target()
    round_weights_(target.model, "bfloat16")
    engine = Engine(target, load_eagle3(default_head_path(), target), num_threads=args.threads)
    prompts = benchmark_prompts(tok, max(args.batch_sizes), args.seed)
    print(f"the rollout copy rounded to bf16, {args.threads} threads; {args.rounds} rounds, kernels alternated")
    rows = measure(engine, prompts, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
