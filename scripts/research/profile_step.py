"""Where a plain decoding step of the target goes, next to the memory-bandwidth floor.

    python -m scripts.research.profile_step [--threads 2] [--reps 20] [--rows 16] [--blocks 9] [--json OUT.json]

Measures, at batch 1 on a held-out prompt (median of ``--reps``, interleaved), once with the
linear layers on torch's GEMM (``linear torch``) and three times on the decoding kernel of
``rollout.kernels.native_linear`` (where it is available): with the modules' own forwards
(``linear native unfused``), with the leaner layer forwards of ``rollout.kernels.fused_layers`` inside
the model's own decoder stack (``linear native own stack``) and with those and the stack loop
(``linear native``, the engine's default):
- ``engine_ms``: one token of our autoregressive mode (``Engine.generate``, spec off),
  per token over a 32-token completion;
- ``forward_ms``: one target forward over the pending token (``ModelRunner.verify_forward``:
  the decoder stack, the lm_head, the KV-cache write and the mask);
- ``lm_head_ms``: the 49152 x 576 output projection alone;
- ``floor_ms``: reading the fp32 weights once (lm_head included, the tied embedding read
  once) at the bandwidth measured here (``bandwidth_gbs``: a sum over a 1 GiB tensor);
- ``ops``: the profiler's self CPU time per op category over ``--reps`` forwards
  (matmul, attention, elementwise/norm/rope, copies and views, other), in percent; the
  kernel's calls count as matmul.

``--rows N`` also times the decoding kernel alone at every row count 1..N, for each distinct
shape of the target's linear layers (the weight reread from cache, so the tile's arithmetic
shows, not the memory): a row count slower than the next larger one is flagged, as it points
at a register tile the compiler handled badly (GCC 12 once spilled the 7-row tile's panel rows
to the stack: 2x slower than 8 rows). It also times one pass over all of the target's linear
weights at each row count, streamed from memory (the weights are larger than the caches), next
to the 1-row pass: up to the rows where the FMAs take longer than reading the weights, a pass
should cost about what the 1-row pass does (on a 2-core EPYC the kernel once streamed 5+ rows
10-35% slower than 4, until it requested the panels into L2 further ahead).

``--blocks N`` times the engine's target forward over 1..N block tokens at batch 1
(``rollout.engine.timing.step_costs``, the T(n) of ``scripts/bench_rollout.py``'s bound), so a verify
block's cost against a plain step shows without a benchmark run.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from rollout.engine.engine import Engine  # noqa: E402
from rollout.engine.runner import ModelRunner  # noqa: E402
from rollout.engine.timing import step_costs, upper_median  # noqa: E402
from rollout.kernels import native_linear  # noqa: E402
from rollout.options import EngineOptions  # noqa: E402
from rollout.params import SamplingParams, SpecConfig  # noqa: E402
from scripts.cli import positive_int  # noqa: E402

MATMUL = {"mm", "addmm", "bmm", "matmul", "linear", "hr_linear"}
ELEMENTWISE = {"mul", "add", "pow", "mean", "rsqrt", "silu", "neg", "sin", "cos", "div", "div_", "sum", "where",
               "softmax", "_softmax", "sub", "exp", "scalar_tensor", "result_type", "add_", "mul_"}
COPIES = {"copy_", "_to_copy", "to", "cat", "view", "transpose", "slice", "as_strided", "expand", "reshape", "t",
          "unsqueeze", "narrow", "contiguous", "empty", "empty_strided", "scatter_", "index_select", "gather",
          "select", "clone", "_unsafe_view", "split", "chunk"}


def bandwidth_gbs(mib: int = 1024, reps: int = 5) -> float:
    x = torch.ones(mib * 2**18)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / upper_median(times[1:]) / 1e9


def categorise(name: str) -> str:
    """Op category of a profiler event name."""
    op = name.removeprefix("aten::")
    if op in MATMUL:
        return "matmul"
    if "attention" in op:
        return "attention"
    if op in ELEMENTWISE:
        return "elementwise/norm/rope"
    if op in COPIES:
        return "copies/views"
    return "other"


def measure(target, prompt: list[int], reps: int = 20, bandwidth: float | None = None,
            linear: str = "torch", fused: bool = True, stack: bool = True) -> dict:
    """The figures of the module docstring for ``target`` on one tokenised ``prompt``, with the
    linear layers computing as ``Engine(linear=...)`` does (``torch`` or ``native``); ``fused``
    False: the modules' own forwards instead of ``rollout.kernels.fused_layers``'
    (``EngineOptions(fused=False)``); ``stack`` False: the decoder stack's own forward around them
    (``EngineOptions(fused_stack=False)``)."""
    return _measure(target, prompt, reps, bandwidth, linear, EngineOptions(fused=fused, fused_stack=stack))


def _measure(target, prompt: list[int], reps: int, bandwidth: float | None, linear: str,
             options: EngineOptions) -> dict:
    engine = Engine(target, None, num_threads=torch.get_num_threads(), linear=linear, options=options)
    routed = engine.linear_routing()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    runner = ModelRunner(target, None, options=options)
    lm_head = target.model.get_output_embeddings()
    times: dict[str, list[float]] = {"engine_ms": [], "forward_ms": [], "lm_head_ms": []}
    with torch.inference_mode(), routed:
        logits = runner.start([prompt], len(prompt) + 8)
        runner.pending = logits.argmax(-1)
        block, offsets = runner.pending[:, None], torch.zeros(1, 1, dtype=torch.long, device=target.device)
        hidden = torch.randn(1, 1, target.hidden_size, dtype=target.dtype, device=target.device)
        engine.generate([prompt], sampling, SpecConfig(mode="off"))  # warm-up
        for rep in range(max(1, reps // 10) + 1):
            t = engine.generate([prompt], sampling, SpecConfig(mode="off"), seed=rep).timings
            if rep:
                times["engine_ms"].append(t.total_s / t.tokens * 1000)
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            runner.verify_forward(block, offsets, None)
            t1 = time.perf_counter()
            lm_head(hidden)
            t2 = time.perf_counter()
            if rep:
                times["forward_ms"].append((t1 - t0) * 1000)
                times["lm_head_ms"].append((t2 - t1) * 1000)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                runner.verify_forward(block, offsets, None)
    ops: dict[str, float] = {}
    for ev in prof.key_averages():
        ops[categorise(ev.key)] = ops.get(categorise(ev.key), 0.0) + ev.self_cpu_time_total
    total = sum(ops.values()) or 1.0
    bw = bandwidth or bandwidth_gbs()
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    out = {k: upper_median(v) for k, v in times.items()}
    out.update(bandwidth_gbs=bw, weight_mb=weights / 1e6, floor_ms=weights / (bw * 1e9) * 1000,
               ops={k: round(100 * v / total, 1) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])})
    return out


def linear_rows(target, max_rows: int, reps: int = 7) -> dict[str, list[float]]:
    """Microseconds of one kernel call per row count 1..max_rows (median of ``reps`` timings of a
    loop of calls), for each distinct ``[N, K]`` of the target's linear layers (key ``"NxK"``)."""
    shapes = sorted({tuple(m.weight.shape) for m in target.modules() if isinstance(m, torch.nn.Linear)})
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen)
        panels = native_linear.pack(w)
        calls = max(1, int(2e7 // (n * k)))  # about 80 MB of weights read per timing
        warm = torch.randn(1, k, generator=gen)
        for _ in range(calls):
            native_linear.linear(warm, w, None, panels)
        row = []
        for m in range(1, max_rows + 1):
            x = torch.randn(m, k, generator=gen)
            native_linear.linear(x, w, None, panels)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(calls):
                    native_linear.linear(x, w, None, panels)
                times.append((time.perf_counter() - t0) / calls * 1e6)
            row.append(upper_median(times))
        out[f"{n}x{k}"] = row
    return out


def streamed_rows(target, max_rows: int, reps: int = 5) -> list[float]:
    """Milliseconds of one pass of kernel calls over every distinct linear weight of ``target``
    (packed once, so each pass streams them from memory) at each row count 1..max_rows (median
    of ``reps`` passes, row counts interleaved)."""
    weights = list({id(m.weight): m.weight.detach() for m in target.modules() if isinstance(m, torch.nn.Linear)
                    and native_linear._packable(m.weight)}.values())
    packed = [native_linear.pack(w) for w in weights]
    gen = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}
          for m in range(1, max_rows + 1)}
    times: dict[int, list[float]] = {m: [] for m in xs}
    for rep in range(reps + 1):  # rep 0 warms up
        for m in xs:
            t0 = time.perf_counter()
            for w, panels in zip(weights, packed):
                native_linear.linear(xs[m][w.shape[1]], w, None, panels)
            if rep:
                times[m].append((time.perf_counter() - t0) * 1000)
    return [upper_median(times[m]) for m in xs]


def block_costs(target, prompt: list[int], max_block: int, reps: int = 20) -> list[float]:
    """Milliseconds of the engine's target forward over 1..max_block block tokens at batch 1 after
    ``prompt``'s prefill (``rollout.engine.timing.step_costs``)."""
    engine = Engine(target, None, num_threads=torch.get_num_threads())
    costs = step_costs(engine, [prompt], list(range(1, max_block + 1)), reps)
    return [costs[n] * 1000 for n in range(1, max_block + 1)]


def slow_rows(times: list[float], slack: float = 1.3) -> list[int]:
    """Row counts (1-based) whose time exceeds ``slack`` x the next larger row count's."""
    return [m + 1 for m in range(len(times) - 1) if times[m] > slack * times[m + 1]]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write {linear mode: figures} here")
    ap.add_argument("--rows", type=int, default=0,
                    help="also time the native kernel alone at 1..ROWS input rows per layer shape, and streaming "
                         "all the weights")
    ap.add_argument("--blocks", type=int, default=0,
                    help="also time the engine's target forward over 1..BLOCKS block tokens (batch 1)")
    args = ap.parse_args(argv)
    from rollout.engine.engine import available_cores
    from rollout.models import load_embedded_target
    from trainers.tasks.general import benchmark_prompts

    torch.set_num_threads(args.threads or available_cores())
    target, tok = load_embedded_target()
    prompt = benchmark_prompts(tok, 1, 0)[0]
    bandwidth = bandwidth_gbs()
    modes = ("torch", "native unfused", "native own stack", "native") if native_linear.available() else ("torch",)
    res = {mode: measure(target, prompt, args.reps, bandwidth, linear=mode.split()[0], fused=mode != "native unfused",
                         stack=mode != "native own stack") for mode in modes}
    for mode, r in res.items():
        print(f"threads {torch.get_num_threads()}, linear {mode}: engine {r['engine_ms']:.1f} ms/token, "
              f"forward {r['forward_ms']:.1f} ms, lm_head {r['lm_head_ms']:.1f} ms; "
              f"floor {r['floor_ms']:.1f} ms ({r['weight_mb']:.0f} MB fp32 at {r['bandwidth_gbs']:.1f} GB/s); "
              f"self CPU time by op category (%): {r['ops']}")
    if args.rows and native_linear.available():
        rows = linear_rows(target, args.rows)
        print(f"native kernel alone, us per call at 1..{args.rows} rows (weights from cache):")
        for shape, times in rows.items():
            flag = slow_rows(times)
            print(f"  {shape:>10}: " + " ".join(f"{t:.0f}" for t in times)
                  + (f"   SLOWER THAN THE NEXT ROW COUNT at {flag} rows" if flag else ""))
        res["linear_rows_us"] = rows
        streamed = streamed_rows(target, args.rows)
        print(f"native kernel alone, ms per pass over all the weights at 1..{args.rows} rows (streamed from memory): "
              + " ".join(f"{t:.1f}" for t in streamed) + "; over the 1-row pass: "
              + " ".join(f"{t / streamed[0]:.2f}" for t in streamed))
        res["streamed_rows_ms"] = streamed
    if args.blocks:
        blocks = block_costs(target, prompt, args.blocks)
        print(f"engine target forward, ms at 1..{args.blocks} block tokens (batch 1): "
              + " ".join(f"T({n}) {t:.1f}" for n, t in enumerate(blocks, 1)) + "; over T(1): "
              + " ".join(f"{t / blocks[0]:.2f}" for t in blocks))
        res["block_ms"] = blocks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
