"""The measurement of ``scripts/bench_rollout.py`` (a helper module of that script, not an entry
point; its docstring defines the columns): per batch size, every configuration row
(``scripts.bench_rows``) on every batch of prompts, interleaved, the engines' step costs timed on
each batch after its runs, and the rows assembled from the sums. A *call* is one generate of one
row on one batch of prompts; a row's *totals* are its calls' figures summed (tokens, seconds,
emitted and kept tokens, row rounds, the engine's timings); *step costs* are T(n), T_draft and T_chain(K)
(``rollout.engine.timing.step_costs``), keyed by the block size n, ``draft`` and ``chainK``.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from statistics import median
import sys
import time

import torch

from rollout.engine.engine import Engine
from rollout.engine.planner import trace_summary
from rollout.engine.timing import chain_key, cost_label, step_costs
from rollout.options import EngineOptions
from rollout.outputs import tau_with_error
from rollout.params import SamplingParams, SpecConfig
from scripts.bench_rows import engine_with, header, plan_line, print_row, row_configs, widths
from verifiers import native


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def batches(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def run_hf(model, group: list[list[int]], sampling: SamplingParams, pad_id: int, seed: int) -> dict:
    """HF generate on one batch (left padding), sampling like ours; counts tokens up to and
    including the first stop token."""
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
                               top_k=0, top_p=1.0, max_new_tokens=sampling.max_new_tokens,
                               eos_token_id=list(sampling.stop_token_ids), pad_token_id=pad_id)
    width = max(len(p) for p in group)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    seconds = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        stops = [j for j, t in enumerate(row) if t in sampling.stop_token_ids]
        tokens += stops[0] + 1 if stops else len(row)
    return {"tokens": tokens, "seconds": seconds, "emitted": tokens, "kept": tokens, "row_rounds": tokens}


def run_ours(engine: Engine, group: list[list[int]], sampling, spec, verifier, seed: int,
             backend: str | None = None) -> dict:
    """One generate call; ``backend`` (native / torch) pins the verifier backend (None: default)."""
    with contextlib.nullcontext() if backend is None else native.forced(backend == "native"):
        result = engine.generate(group, sampling, spec, verifier, seed=seed)
    t = result.timings
    # kept: the tokens the rounds added to the completions (each row's first token is the prefill's);
    # emitted also counts those of a row's last round past its stop token or token limit
    kept = sum(max(0, len(c.completion_ids) - 1) for c in result.completions)
    return {"tokens": t.tokens, "seconds": t.total_s, "emitted": t.emitted, "kept": kept, "row_rounds": t.row_rounds,
            "draft_s": t.draft_s, "verify_s": t.verify_s, "other_s": t.other_s, "setup_s": t.setup_s,
            "draft_forwards": t.draft_forwards, "draft_rounds": t.rounds - t.plain_rounds,
            "step_emitted": [c.step_emitted for c in result.completions]}  # each row's tokens per round


def run_config(config: tuple, target, engine: Engine, group: list[list[int]], sampling, pad_id: int,
               seed: int) -> dict:
    """One call of a configuration row ``(mode, verifier name, spec, verifier, backend)``."""
    _, _, spec, verifier, backend = config
    if spec is None:
        return run_hf(target.model, group, sampling, pad_id, seed)
    if isinstance(backend, Engine):  # a row on another engine
        return run_ours(backend, group, sampling, spec, verifier, seed)
    if isinstance(backend, EngineOptions):  # the default engine's target and head under other options
        return run_ours(engine_with(engine, backend), group, sampling, spec, verifier, seed)
    return run_ours(engine, group, sampling, spec, verifier, seed, backend)


def run_order(n: int, i: int, order: str) -> list[int]:
    """The order of the ``n`` configurations on batch ``i`` of prompts: rotated by ``i`` or as listed."""
    start = i % n if order == "rotate" else 0
    return [*range(start, n), *range(start)]


def bound(spec: SpecConfig | None, tau: float, costs: dict, batch: int, steps: float | None = None,
          base: float | None = None) -> float | None:
    """tau x T(1) / (T(n) + drafting) (see ``scripts/bench_rollout.py``'s docstring: an upper bound
    at batch 1, the cost model's estimate above it); None without one, or for a config that does
    not draft in every round of a call of ``batch`` rows (``max_batch``: auto, or below ``batch``:
    its plain rounds would enter tau while every round is charged the drafting). tau: the tokens
    kept per row per round. Drafting: ``steps`` x T_draft, or T_draft + T_chain(K) for a chain
    whose one-call cost was measured. ``steps``: the head steps a drafting round ran on average
    (a sampled tree's shape is re-planned during a call); None: the config's own (K, or the
    depth). ``base``: the T(1) of the autoregressive mode the speedup is over, when ``costs`` are
    another engine's."""
    if spec is None or not spec.speculative or spec.auto or not spec.drafts_at(batch) or "draft" not in costs:
        return None
    n, fixed = (spec.num_draft_tokens + 1, spec.num_draft_tokens) if spec.mode == "chain" else \
        (spec.total_tokens + 1, spec.depth)
    steps = fixed if steps is None else steps
    chain = chain_key(spec.num_draft_tokens) if spec.mode == "chain" else None
    drafting = costs["draft"] + costs[chain] if chain in costs else steps * costs["draft"]  # root + one call
    return tau * (costs[1] if base is None else base) / (costs[n] + drafting)


def measure(args, target, tok, engine, prompts, sampling) -> list[dict]:
    """Per batch size, every configuration on every batch of prompts, interleaved batch by
    batch (so a change of machine load during the run hits all configurations alike)."""
    if args.passes < 1:
        raise SystemExit(f"--passes must be >= 1, got {args.passes}")
    rows = []
    pad_id = tok.pad_token_id or 0
    if args.planner_trace:
        engine.trace_plans()
    for n, size in enumerate(int(b) for b in args.batch_sizes.split(",")):
        configs = row_configs(args, target, engine)
        if n == 0:
            width = widths(configs)
            print(header(width), flush=True)
        groups = batches(prompts, size)
        # the engines whose step costs are timed: the default one, the --bf16-weights and --int8-head ones
        timed = [(eng, label) for eng, label in ((engine, ""), (args.rounded, " [bf16 weights]"),
                                                 (args.int8, " [int8 head]")) if eng is not None]
        for w in range(args.plan_warmup):  # the planners learn their costs (kept by the engine)
            for c in configs:
                if c[2] is not None and c[2].auto:
                    run_config(c, target, engine, groups[0], sampling, pad_id, args.seed + 10_000 + w)
        traced = plan_marks(engine, configs, sampling)  # where each auto row's timed rounds begin
        totals, calls, samples = run_interleaved(args, target, engine, configs, groups, sampling, pad_id, timed, size)
        costs_of = {key: {step: median(values) for step, values in taken.items()} for key, taken in samples.items()}
        for eng, label in timed:
            c, taken = costs_of[id(eng)], samples[id(eng)]
            if c:
                print(f"  batch {size} step costs{label} (ms, median of {len(taken[1])} over the run): " + ", ".join(
                    f"{cost_label(k)} {v * 1000:.1f}" for k, v in c.items()),
                    flush=True)
        rows += size_rows(args, size, configs, totals, calls, costs_of, engine, prompts, width)
        for c, start in traced.items():
            trace = engine.plan_trace(configs[c][2], configs[c][3], sampling)
            if trace is None:  # not tracing
                continue
            row = next(r for r in rows if r["batch"] == size and (r["mode"], r["verifier"]) == configs[c][:2])
            row["planner"] = trace_summary(trace[start:])
            row["planner_trace"] = trace[start:]
            print(plan_line(row), flush=True)
    return rows


def run_interleaved(args, target, engine: Engine, configs: list[tuple], groups: list[list[list[int]]], sampling,
                    pad_id: int, timed: list[tuple], size: int) -> tuple[list[dict], list[list[float]], dict]:
    """Every configuration on every batch of prompts (``--passes`` times over them, other seeds),
    batch ``i`` in ``run_order``; after each batch's runs, each ``timed`` engine's step costs on it.
    Returns each configuration's totals, the tokens/s of each of its calls in order, and the step
    costs taken (``id(engine)`` -> step -> seconds, every repetition)."""
    totals: list[dict] = [{} for _ in configs]
    calls: list[list[float]] = [[] for _ in configs]  # tokens/s of each call, in order
    blocks = sorted({1} | {c[2].block_size for c in configs if c[2] is not None and c[2].speculative})
    chains = tuple(sorted({c[2].num_draft_tokens for c in configs if c[2] is not None and c[2].speculative
                           and c[2].mode == "chain" and not c[2].auto}))
    samples: dict = {id(eng): {} for eng, _ in timed}  # engine -> step -> seconds, over every batch of prompts
    for i, group in ((p * len(groups) + g, group) for p in range(args.passes) for g, group in enumerate(groups)):
        for c in run_order(len(configs), i, args.order):
            tot = totals[c]
            res = run_config(configs[c], target, engine, group, sampling, pad_id, args.seed + i)
            calls[c].append(res["tokens"] / res["seconds"])
            for key, value in res.items():  # numbers summed, lists (each row's step_emitted) joined
                tot[key] = tot.get(key, [] if isinstance(value, list) else 0) + value
            tot["rss_mb"] = max(tot.get("rss_mb", 0.0), rss_mb())
        if args.cost_reps > 0:
            for eng, _ in timed:
                for step, values in step_costs(eng, group, blocks, args.cost_reps, raw=True, chains=chains,
                                                 temperature=sampling.temperature).items():
                    samples[id(eng)].setdefault(step, []).extend(values)
        print(f"  batch {size}: {i + 1}/{len(groups) * args.passes} batches done", file=sys.stderr, flush=True)
    return totals, calls, samples


def size_rows(args, size: int, configs: list[tuple], totals: list[dict], calls: list[list[float]], costs_of: dict,
              engine: Engine, prompts: list[list[int]], width: tuple[int, int]) -> list[dict]:
    """The rows of batch size ``size``, each printed as it is made: a configuration's totals and
    calls (``run_interleaved``'s) with its tau, speedups, paired ratios and lengths against the
    autoregressive mode, its bound (``costs_of``: each timed engine's median step costs) and the
    same figures over the decoding alone."""
    costs = costs_of[id(engine)]
    # keyed by (mode, verifier): the verifiers of one speculative mode are separate rows
    keys = [(mode, vname) for mode, vname, *_ in configs]
    speeds = {key: tot["tokens"] / tot["seconds"] for key, tot in zip(keys, totals)}
    # decoding only: without each call's setup (weight packing, prefill), which the bound leaves out
    decode = {key: t["tokens"] / (t["seconds"] - t["setup_s"]) for key, t in zip(keys, totals) if "setup_s" in t}
    ar, hf = speeds[("off", "lossless")], speeds.get(("hf generate", "-"))
    ar_decode = decode.get(("off", "lossless"))
    ar_index = keys.index(("off", "lossless"))
    ar_calls, ar_tokens = calls[ar_index], totals[ar_index]["tokens"]
    rows = []
    for (mode, vname, spec, _, backend), tot, mine_calls in zip(configs, totals, calls):
        row = {"batch": size, "mode": mode, "verifier": vname} | tot
        row_rounds = max(1, row.pop("row_rounds"))
        row["tau"] = row.pop("emitted") / row_rounds  # the acceptance: tokens emitted per row per round
        row["tau_kept"] = row.pop("kept") / row_rounds  # the bound's: tokens kept (cut after a stop or the limit)
        # tau's standard error, each row of each call one unit (None: HF rows, or fewer than 2 rows)
        se = tau_with_error(row.pop("step_emitted"))[1] if "step_emitted" in row else math.nan
        row["tau_se"] = None if math.isnan(se) else se
        forwards, rounds = row.pop("draft_forwards", 0), row.pop("draft_rounds", 0)
        steps = forwards / rounds if spec is not None and spec.sampled_tree and rounds else None
        row["peak_rss_mb"] = max(peak_rss_mb(), row["rss_mb"])
        row["tokens_per_s"] = speeds[(mode, vname)]
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar
        # mean completion length against the autoregressive mode's on the same prompts: a lossy
        # verifier that shortens completions is drift, and its calls spread their setup over fewer tokens
        row["mean_length"] = row["tokens"] / (len(prompts) * args.passes)
        row["length_vs_ar"] = row["tokens"] / ar_tokens
        # per batch of prompts, this row's call against the autoregressive call on the same
        # prompts, run next to it: the median and range of those paired ratios
        pairs = sorted(x / y for x, y in zip(mine_calls, ar_calls))
        row["paired_vs_ar"] = {"median": median(pairs), "min": pairs[0], "max": pairs[-1], "n": len(pairs)}
        row["speedup_vs_hf"] = row["tokens_per_s"] / hf if hf is not None else None
        # a row on another engine has a bound from that engine's own step costs, if they were measured
        own = costs_of.get(id(backend)) if isinstance(backend, Engine) else costs  # --torch-linear's: not timed
        row["step_costs_ms"] = {str(k): v * 1000 for k, v in (own or {}).items()}
        row["bound"] = bound(spec, row["tau_kept"], own, min(size, len(prompts)), steps, costs.get(1)) \
            if own and not isinstance(backend, EngineOptions) else None
        row["of_bound"] = row["speedup_vs_ar"] / row["bound"] if row["bound"] else None
        mine = decode.get((mode, vname))
        row["decode_tokens_per_s"] = mine
        row["decode_vs_ar"] = mine / ar_decode if mine is not None else None
        row["decode_of_bound"] = row["decode_vs_ar"] / row["bound"] if row["bound"] and mine else None
        # the whole-call ceiling: this row's setup and tokens, its decoding exactly at the bound
        row["call_bound"] = (row["tokens"] / (tot["setup_s"] + row["tokens"] / (row["bound"] * ar_decode)) / ar
                             if row["bound"] and mine and ar_decode else None)
        rows.append(row)
        print_row(row, width)
    return rows


def plan_marks(engine: Engine, configs: list[tuple], sampling) -> dict[int, int]:
    """For each ``max_batch: auto`` row on the default engine (not another engine, nor other
    options): where its planner's records of the coming runs begin (0 while the planner is not
    made: its first call makes it)."""
    out = {}
    for c, (_, _, spec, verifier, backend) in enumerate(configs):
        if spec is not None and spec.auto and not isinstance(backend, (Engine, EngineOptions)):
            out[c] = len(engine.plan_trace(spec, verifier, sampling) or [])
    return out
