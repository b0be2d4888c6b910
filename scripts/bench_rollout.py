"""Rollout throughput: our engine (autoregressive, chain, tree; several verifiers) against
Hugging Face ``generate``, side by side on the same prompts and sampling settings.
The engine's linear layers run on ``rollout.kernels.native_linear``'s kernel where it is available
(its default), with the leaner Llama layer forwards of ``rollout.kernels.fused_layers``;
``--torch-linear`` adds the autoregressive mode on torch's GEMM as a row, ``--python-layers`` each
configuration with the decoder layers run from Python instead of ``csrc/layer.cpp``, ``--python-draft``
each speculative configuration with the draft head's forwards run from Python instead of one C++ call
each (``rollout.kernels.native_draft``), ``--draft-steps`` each with a sampled chain's drafting one C++ call
per step instead of one call for the whole chain (``EngineOptions(draft_chains=False)``), ``--unfused`` the
autoregressive mode with the modules' own forwards (kernel still on), ``--fp32-head`` each
speculative configuration with the draft head's weights packed as fp32 panels (the default
packs the shipped bf16-valued head as bf16 panels: the same draft logits, half the bytes;
``EngineOptions(compact_panels=False)``). These rows run the default engine's target and head on an
engine built with those ``rollout.options.EngineOptions`` off, and their labels name them
(``off [fused off]``, ``chain K=3 sampled [native_layers off]``). ``--int8-head`` adds each
speculative configuration on a second engine
over the same target whose head copy is rounded to int8 weights (the hf backend's
``drafter_weights: int8``, ``rollout.kernels.quantize``: a quarter of fp32's bytes per draft step, exact
rollouts; its own tau, step costs and bounds). ``--bf16-weights`` adds the autoregressive mode and each speculative
configuration on a second engine whose target copy has its weights rounded to bf16 values (the hf
backend's ``weights: bfloat16``: another model, half the bytes per step; its own step costs and
bounds), with their speedups over the exact autoregressive mode.

    python -m scripts.bench_rollout --batch-sizes 1,8,32 --max-new-tokens 128 --prompts 32 \\
        --verifiers lossless,mars,overshoot --json OUT.json
    python -m scripts.bench_rollout --quick          # a small smoke run
    python -m scripts.bench_rollout ... --plot speed.png   # speedups next to their bounds (scripts.bench_plot)
    python -m scripts.bench_rollout ... --max-batch auto --planner-trace plans.json   # why auto chose what

Target: the embedded SmolLM2-135M-Instruct; drafter: the shipped EAGLE-3 head (or
``--head``). Prompts: held-out arithmetic word problems with the chat template. For each
batch size the prompts are split into batches of that size and generated one batch after
the other; tokens/s = completion tokens / wall time (completions stop at EOS or the token
limit). tau = mean tokens emitted per row per target forward (the acceptance; ``tau_kept`` in the
JSON: the tokens the completions kept, without a row's last-round tokens past its stop token or
token limit, which tokens/s does not count either). Speedups are over our
autoregressive mode ("off") and over HF generate at the same batch size. All
configurations run on each batch of prompts before the next batch (interleaved), so a
change of machine load hits them alike; batch i of prompts runs them in an order rotated by
i (``--order rotate``, the default; ``fixed``: the listed order every time), so that no
configuration always runs first or last (on this shared machine the configuration run last
in each batch lost a few percent whatever it was). rss_mb is the largest resident memory
seen after a run of the configuration, peak_rss_mb the process peak.
``--group N`` repeats each prompt N times in a row, as GRPO samples a group per prompt (the
engine prefills identical prompts once; ``--unshared-prefill`` adds our autoregressive
mode with every row prefilled on its own as a row).
``--planner-trace OUT.json``: the planner of every ``max_batch: auto`` row records each round (its
choice, why, the rates it compared, its seconds and emitted tokens; ``RoundPlanner.trace``); after
each batch size a line per auto row counts its rounds by choice and reason, and the records go to
OUT.json per row (calls in order; ``call`` numbers them within the row's planner).
``--repeat N`` then reruns one speculative configuration N times and reports the RSS
after each run (memory growth check).

Bound: for each batch size the script also times the engine's own steps: a target forward
over 1 and over n block tokens per row, T(1) and T(n), and one draft step, T_draft, each
the median of ``--cost-reps`` interleaved repetitions on every batch of prompts, taken
right after that batch's configurations ran (so the costs are sampled across the run, as
the throughput is, not in one moment before it). The cost model then puts a speculative
configuration at ``bound = tau_kept x T(1) / (T(n) + steps x T_draft)`` times our autoregressive
mode (chain: n = K + 1, steps = K; tree: n = total_tokens + 1, steps = depth, a tree's draft
levels counted as single-token steps, so its bound is optimistic; a sampled tree: the head steps
its drafting rounds ran on average, as its shape is re-planned during a call). A chain whose drafts
the engine makes in one C++ call (``hr_draft_chain``: sampled and greedy chains with the native
kernels) has ``K x T_draft`` replaced by ``T_draft + T_chain(K)``: the root step, then that call
timed as the engine runs it (its K draws and K - 1 steps; greedy-drafted rows at T > 0 take the
sampled chain's time, a little more than their argmax draws cost). At batch 1 this is an upper
bound: every round costs at least its forward and its drafting. Above batch 1 it is the cost
model's estimate, not a bound, and a row can exceed it with no noise at all: tau is per row, but the
step costs are timed with every row of the batch live, while a call's rows drop out as they
finish, and its later rounds, over fewer rows, cost less next to a plain step than the full
batch's T(n) / T(1) the estimate charges (on this CPU that ratio grows with the rows: verify rows
are compute-bound in fp32 from batch ~8). ``of bound`` = achieved speedup / bound shows how far
the engine (verifier, bookkeeping, Python) is from its own cost model (above batch 1, as ``call
bd`` and ``dec bd``, against the estimate). Rows that do not draft in every round have no bound:
``max_batch: auto``, and a numeric ``max_batch`` below the batch size (its plain rounds over more
rows would enter tau while the bound charged every round the drafting).
``paired vs AR``: the median (and range) over the batches of prompts of a row's tokens/s against
the autoregressive mode's on the same prompts, run next to it (``--passes N`` runs over the
prompts N times with other seeds: more pairs, against this machine's noise; rows that decode
alike still differ by up to a tenth in one pass). An ``auto`` row's planner is kept by the
engine across calls (and batch sizes): by default the row includes its first calls' probes;
``--plan-warmup N`` first runs each ``auto`` configuration N times, untimed, on the first
batch of prompts with other seeds (a training run's later calls).
The bound leaves out what every call pays before its first round (packing the weights for
the linear kernel, the prefill: ``Timings.setup_s``), a larger share of a faster call, so
``dec AR`` / ``dec bd`` repeat the speedup and its share of the bound over the decoding
alone (each call's time after its setup). ``len``: the row's completion tokens over the
autoregressive mode's on the same prompts (``mean_length`` per prompt in the JSON). A lossy
verifier that shortens completions drifts (MARS on tree candidates runs near greedy: about
0.63x on the held-out arithmetic), and its calls spread their fixed setup over fewer tokens,
which lowers its whole-call ``of bound`` but not ``dec bd``. ``call bd`` puts the setup back:
the speedup the row's calls would reach with their own setup and tokens if their decoding ran
exactly at the bound (``tokens / (setup + tokens / (bound x AR's decoding rate))`` over AR's
whole-call rate), the ceiling for the whole-call speedup this head and this setup allow (at
batch 1; above it an estimate, as the bound).
``+-se``: tau's standard error (``tau_se`` in the JSON), each row of each call one unit, as a
round's acceptance depends on its row (``rollout.outputs.tau_with_error``). Two heads or rules
whose tau differ by less than about twice the larger one are not told apart by this run: at 32
prompts of 96 tokens at batch 1 it is 0.09-0.11, 4% of a tau of 2.6 (lossless block K = 6, the
shipped head, 2026-12-06), so a tuned head of that date (tau 2.48-2.57 against 2.52-2.61) was not
told apart here; 96 prompts and two seeds per row put its gain on these prompts at +0.7%.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")  # before torch loads MKL: fast small matmuls on AMD CPUs

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from rollout.eagle3 import default_head_path, load_eagle3  # noqa: E402
from rollout.engine.engine import Engine, available_cores  # noqa: E402
from rollout.models import load_embedded_target  # noqa: E402
from rollout.params import SamplingParams, SpecConfig  # noqa: E402
from scripts.bench_measure import measure, peak_rss_mb, rss_mb  # noqa: E402
from scripts.bench_plot import plot_rows  # noqa: E402
from scripts.bench_rows import describe, int8_engine, rounded_engine, spec_configs  # noqa: E402
from scripts.cli import batch_sizes, head_folder, positive_int  # noqa: E402
from trainers.tasks.general import benchmark_prompts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32", type=batch_sizes)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--verifiers", default="lossless,mars,overshoot",
                    help="comma list of rule names with their default parameters (mars theta=0.9, overshoot "
                         "lenience=0.5), or ';' list of specs with parameters, e.g. "
                         "'overshoot:lenience=0.5;overshoot:lenience=0.3' (test=law: rejection towards the rule's "
                         "law, 'mars:theta=0.9,test=law'; test=block: lossless chains verified as a block, "
                         "'lossless:test=block'; both chain rows only)")
    ap.add_argument("--modes", default="chain,tree", help="speculative modes to run (comma list)")
    ap.add_argument("--chain-k", default="3", help="chain length K (comma list: one chain config per K)")
    ap.add_argument("--draft-sampling", default="sampled", choices=("sampled", "greedy"))
    ap.add_argument("--tree", default="3,4,8", help="depth,top_k,total_tokens (';' separates several); an 's' "
                    "in front (s6,3,8) drafts sampled candidates (tree_candidates: sampled)")
    ap.add_argument("--max-batch", default="none",
                    help="spec.max_batch values (comma list; 'none' = draft in every round, 'auto' = "
                         "decide per round from measured costs): draft only while at most this many rows "
                         "are unfinished")
    ap.add_argument("--adaptive-k", action="store_true", help="with max_batch auto: chain length per round")
    ap.add_argument("--passes", type=int, default=1,
                    help="run over the batches of prompts this many times (other seeds each pass): more calls "
                         "per configuration, against this machine's noise")
    ap.add_argument("--plan-warmup", type=int, default=0,
                    help="untimed calls of each max_batch auto configuration on the first batch of prompts "
                         "(other seeds) before each batch size's timed ones: the planner's steady state, as "
                         "in a training run's later calls (default 0: timed from the engine's first call, "
                         "probes included)")
    ap.add_argument("--cost-reps", type=int, default=3,
                    help="timed repetitions of each step cost per batch of prompts (0: no bound)")
    ap.add_argument("--order", default="rotate", choices=("rotate", "fixed"),
                    help="order of the configurations on each batch of prompts: rotated by one per batch "
                         "(default) or always as listed")
    ap.add_argument("--verifier-backend", default=None,
                    help="comma list of native, torch: run each speculative config with each verifier "
                         "backend side by side (default: the default backend only)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--head", default=None, type=head_folder, help="draft head folder (default: the shipped head)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--group", type=int, default=1,
                    help="samples per prompt: each of the --prompts prompts appears this many times in a row")
    ap.add_argument("--unshared-prefill", action="store_true",
                    help="add a row: our autoregressive mode with every row prefilled on its own")
    ap.add_argument("--unfused", action="store_true",
                    help="add our autoregressive mode with every module's own forward (no "
                         "rollout.kernels.fused_layers; the linear kernel still on) as a row")
    ap.add_argument("--python-layers", action="store_true",
                    help="add our autoregressive mode and each speculative configuration with the decoder "
                         "layers run one by one from Python (EngineOptions(native_layers=False), not csrc/layer.cpp) "
                         "as rows (no bound: the step costs use the C++ layers)")
    ap.add_argument("--python-draft", action="store_true",
                    help="add each speculative configuration with the draft head's forwards run from Python "
                         "(EngineOptions(native_draft=False)) as a row (no bound: the step costs use the C++ draft)")
    ap.add_argument("--draft-steps", action="store_true",
                    help="add each speculative configuration with a sampled chain's steps drafted one C++ call "
                         "each (EngineOptions(draft_chains=False), not one hr_draft_chain call) as a row (no bound)")
    ap.add_argument("--fp32-head", action="store_true",
                    help="add each speculative configuration with the head packed as fp32 panels "
                         "(EngineOptions(compact_panels=False)) as a row (no bound: the step costs use compact panels)")
    ap.add_argument("--no-amx", action="store_true",
                    help="add each speculative configuration with AMX tiles off (EngineOptions(amx=False): the bf16 "
                         "head as compact panels, where the CPU has AMX) as a row (no bound: the step costs use the "
                         "tiles)")
    ap.add_argument("--int8-head", action="store_true",
                    help="add each speculative configuration on a head copy rounded to int8 weights (the hf "
                         "backend's drafter_weights: int8) as rows, with their own step costs and bounds")
    ap.add_argument("--torch-linear", action="store_true",
                    help="add our autoregressive mode on torch's GEMM (Engine(linear='torch')) as a row")
    ap.add_argument("--bf16-weights", action="store_true",
                    help="add our autoregressive mode and each speculative configuration on a target copy whose "
                         "weights are rounded to bf16 values (the hf backend's weights: bfloat16) as rows")
    ap.add_argument("--repeat", type=int, default=0, help="memory check: rerun one config N times")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: the usable cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw each row's speedup next to its bound here (scripts.bench_plot; also from a --json file)")
    ap.add_argument("--planner-trace", default=None, metavar="JSON",
                    help="record the rounds of every max_batch auto row's planner here, and count them by reason")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 16 tokens, batch 1,2 (in place of --prompts, --max-new-tokens and --batch-sizes)")
    args = ap.parse_args(argv)
    args.rounded = None  # main sets the --bf16-weights engine (rounded_engine)
    args.int8 = None  # and the --int8-head engine (int8_engine)
    if args.quick:
        args.batch_sizes, args.prompts, args.max_new_tokens = "1,2", 2, 16
    spec_configs(args)  # bad --modes, --tree, --chain-k or --verifiers: refused here, before the models load
    for flag, out in (("--json", args.json), ("--plot", args.plot), ("--planner-trace", args.planner_trace)):
        if out and not Path(out).resolve().parent.is_dir():
            raise SystemExit(f"error: {flag} {out}: the folder {Path(out).resolve().parent} does not exist")
    return args


def memory_check(args, engine, prompts, sampling) -> dict:
    spec, verifier = spec_configs(args)[0]
    size = max(int(b) for b in args.batch_sizes.split(","))
    group = prompts[:size]
    trace = []
    for i in range(args.repeat):
        engine.generate(group, sampling, spec, verifier, seed=args.seed + i)
        trace.append(rss_mb())
    print(f"memory: {args.repeat} x batch {size} ({describe(spec)}, {verifier.name}): RSS after run 1 "
          f"{trace[0]:.0f} MB, after run {args.repeat} {trace[-1]:.0f} MB, peak {peak_rss_mb():.0f} MB")
    return {"repeat": args.repeat, "batch": size, "mode": describe(spec), "verifier": verifier.name,
            "rss_mb": trace, "peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or available_cores()
    target, tok = load_embedded_target()
    head = load_eagle3(args.head or default_head_path(), target)
    engine = Engine(target, head, num_threads=threads)  # sets torch's threads for HF generate too
    args.rounded = rounded_engine(args, threads) if args.bf16_weights else None
    args.int8 = int8_engine(args, target, threads) if args.int8_head else None
    prompts = [p for p in benchmark_prompts(tok, args.prompts, args.seed) for _ in range(args.group)]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=(tok.eos_token_id,))
    print(f"{len(prompts)} prompts{f' ({args.group} per distinct prompt)' if args.group > 1 else ''} (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"T={args.temperature}, max_new_tokens={args.max_new_tokens}, threads={torch.get_num_threads()}, "
          f"MKL_CBWR={os.environ.get('MKL_CBWR', '-')}")
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4), SpecConfig(mode="chain"))  # warm-up
    rows = measure(args, target, tok, engine, prompts, sampling)
    traces = [{"batch": r["batch"], "mode": r["mode"], "verifier": r["verifier"], "rounds": r.pop("planner_trace")}
              for r in rows if "planner_trace" in r]
    if args.planner_trace:
        with open(args.planner_trace, "w") as f:
            json.dump(traces, f)
        print(f"wrote {args.planner_trace} ({sum(len(t['rounds']) for t in traces)} rounds of {len(traces)} rows)")
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("rounded", "int8")},  # not the engines
              "results": rows}
    if args.repeat:
        report["memory"] = memory_check(args, engine, prompts, sampling)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_rows(rows, args.plot)}")


if __name__ == "__main__":
    main()
