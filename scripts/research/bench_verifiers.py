"""Time chain verification against one softmax over the same logits and one target forward.

    python -m scripts.research.bench_verifiers [--json OUT] [--repeats 30] [--threads 2] [--backend native,torch]
        [--test rule,law]

For B in {1, 8, 64}, K = 7, V = 49152 (the embedded SmolLM2's vocabulary), every rule:
``verify_chain`` without diagnostics (median of repeats after a warm-up), next to one
``torch.softmax`` over the same target logits [B, K+1, V] timed interleaved with it (so
both see the same machine load). The goal is a ratio <= 4. At B = 8 it is also compared
with one forward of a randomly initialised LlamaForCausalLM of SmolLM2-135M's exact
shape (timing does not depend on the weights): 8 new tokens per row over a 200-token KV
prefix; the goal is < 5% of that forward.

Then candidate (tree node) verification: N in {1, 8, 64} nodes with m = 4 candidates each,
against one softmax over the same [N, V] logits.

``--backend``: ``native`` is the fused C++ verifier that ``verify_chain`` uses on the CPU
(verifiers/native.py), ``torch`` the PyTorch one (other devices, and the fallback); both
listed: timed side by side in the same interleaved rounds. ``--test rule,law`` adds each rule
with ``verify_chain(..., test="law")`` (rejection towards the rule's law; rows ``[test=law]``).

Inputs: target logits 15 + 3 N(0, 1) (positive, like SmolLM2's, so MARS's ratio test
relaxes some positions), draft logits = target + N(0, 1), drafts sampled from q.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from rollout.engine.allocator import tune_malloc
from scripts.cli import positive_int
from verifiers import get_rule, native, verify_candidates, verify_chain
from verifiers.chain import TESTS

RULES = [("lossless", {}), ("mars", {"theta": 0.9}), ("overshoot", {"lenience": 0.5}),
         ("overshoot", {"lenience": 0.5, "min_p": 0.1}), ("typical", {}), ("min_p", {}),
         ("cos", {"lam": 0.5})]


def _label(name: str, params: dict) -> str:
    return name + ("(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


def _inputs(b: int, k: int, v: int, temperature: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = 15 + 3 * torch.randn(b, k + 1, v, generator=g)
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    q = torch.softmax(draft / temperature, -1).reshape(-1, v)
    x = torch.multinomial(q, 1, generator=g).reshape(b, k)
    return target, draft, x


def _interleaved(fns: dict, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each function, calling them round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _time_rules(size_key: str, size: int, softmax, verify, summary: tuple[str, object], repeats: int,
                backends) -> list[dict]:
    """Every rule on every backend, interleaved with ``softmax``: ``verify(rule, generator)``
    runs one verification; ``summary = (name, fn(result) -> float)`` describes its outcome."""
    fns = {"softmax": softmax}
    outcome = {}
    for name, params in RULES:
        for backend in backends:
            rule, gen = get_rule(name, **params), torch.Generator().manual_seed(1)
            key = (backend, _label(name, params))

            def call(rule=rule, gen=gen, use=backend == "native"):
                with native.forced(use):
                    return verify(rule, gen)

            fns[key] = call
            outcome[key] = summary[1](call())
    med = _interleaved(fns, repeats)
    return [{size_key: size, "backend": key[0], "rule": key[1], "verify_ms": med[key] * 1e3,
             "softmax_ms": med["softmax"] * 1e3, "ratio": med[key] / med["softmax"], summary[0]: val}
            for key, val in outcome.items()]


def bench_verification(batches, k, v, temperature, repeats, backends=("native",), tests=("rule",)) -> list[dict]:
    """Chain verification of B rows of K drafts against one softmax over the [B, K+1, V] logits,
    with each of ``verify_chain``'s ``tests`` (rows of ``law`` are labelled ``[test=law]``)."""
    rows = []
    for b in batches:
        target, draft, x = _inputs(b, k, v, temperature)
        for test in tests:
            found = _time_rules(
                "B", b, lambda: torch.softmax(target, -1),
                lambda rule, gen, test=test: verify_chain(rule, target, draft, x, temperature=temperature,
                                                          generator=gen, test=test),
                ("mean_emitted", lambda res: float(res.num_emitted.float().mean())), repeats, backends)
            rows += [r | {"test": test, "rule": r["rule"] + ("" if test == "rule" else f" [test={test}]")}
                     for r in found]
    return rows


def bench_nodes(nodes, m, v, temperature, repeats, backends=("native",)) -> list[dict]:
    """Candidate (tree node) verification: N nodes with m candidates each (the draft's top m)
    against one softmax over the same [N, V] logits."""
    rows = []
    for n in nodes:
        g = torch.Generator().manual_seed(2)
        target = 15 + 3 * torch.randn(n, v, generator=g)
        cands = (target + torch.randn(n, v, generator=g)).topk(m, -1).indices
        rows += _time_rules(
            "N", n, lambda: torch.softmax(target, -1),
            lambda rule, gen: verify_candidates(rule, target, cands, temperature=temperature, generator=gen),
            ("accepted", lambda res: float((res.accepted_index >= 0).float().mean())), repeats, backends)
    return rows


def _node_table(rows: list[dict], m: int) -> str:
    head = (f"{'N':>3} {'backend':<7} {'rule':<36} {'verify ms':>10} {'softmax ms':>11} {'ratio':>6} "
            f"{'accepted':>8}")
    lines = [f"candidate verification (tree nodes), m = {m} candidates per node:", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['N']:>3} {r['backend']:<7} {r['rule']:<36} {r['verify_ms']:>10.2f} "
                     f"{r['softmax_ms']:>11.2f} {r['ratio']:>6.2f} {r['accepted']:>8.2f}")
    return "\n".join(lines)


def bench_target_forward(batch: int, new: int, prefix: int, repeats: int) -> float:
    """Median ms of one forward of `new` tokens per row over a `prefix`-token KV cache."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 49152, (batch, prefix + new))
    with torch.no_grad():
        cache = DynamicCache(config=config)
        model(ids[:, :prefix], cache=cache, use_cache=True)

        def step():
            model(ids[:, prefix:], cache=cache, use_cache=True)
            cache.crop(-new)  # back to the prefix for the next repeat

        return _interleaved({"forward": step}, repeats, warmup=2)["forward"] * 1e3


def _table(rows: list[dict], forward_ms: float | None) -> str:
    head = f"{'B':>3} {'backend':<7} {'rule':<48} {'verify ms':>10} {'softmax ms':>11} {'ratio':>6} {'emitted':>8}"
    if forward_ms is not None:
        head += f" {'% fwd':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['B']:>3} {r['backend']:<7} {r['rule']:<48} {r['verify_ms']:>10.2f} {r['softmax_ms']:>11.2f} "
                f"{r['ratio']:>6.2f} {r['mean_emitted']:>8.2f}")
        if forward_ms is not None:
            line += f" {100 * r['verify_ms'] / forward_ms:>5.1f}%" if r["B"] == 8 else f" {'':>6}"
        lines.append(line)
    return "\n".join(lines)


def _choices(ap: argparse.ArgumentParser, flag: str, text: str, allowed) -> list[str]:
    """A comma-separated flag value as a list of names from ``allowed`` (exits naming the flag)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(allowed):
        ap.error(f"{flag}: a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--backend", default="native",
                    help="comma-separated: native (fused C++, what the CPU uses), torch (PyTorch)")
    ap.add_argument("--test", default="rule",
                    help="comma-separated verify_chain tests: rule (each rule's own), law (rejection towards its law)")
    ap.add_argument("--nodes", type=int, nargs="*", default=[1, 8, 64],
                    help="node counts for the candidate (tree node) table; none: skip it")
    ap.add_argument("--candidates", type=int, default=4, help="candidates per node")
    ap.add_argument("--no-model", action="store_true", help="skip the target-forward comparison")
    ap.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                    help="glibc malloc settings (rollout/engine/allocator.py; the engine uses 'tuned')")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tuned = args.malloc == "tuned" and tune_malloc()
    backends = _choices(ap, "--backend", args.backend, ("native", "torch"))
    tests = _choices(ap, "--test", args.test, TESTS)
    rows = bench_verification(args.batch, args.k, args.vocab, args.temperature, args.repeats, backends, tests)
    node_rows = bench_nodes(args.nodes, args.candidates, args.vocab, args.temperature, args.repeats, backends)
    forward_ms = None if args.no_model else bench_target_forward(8, 8, 200, max(5, args.repeats // 3))
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {args.threads} threads, K = {args.k}, V = {args.vocab}, "
          f"T = {args.temperature}, malloc {'tuned' if tuned else 'default'}, median of {args.repeats}; load average {load[0]:.1f} on "
          f"{os.cpu_count()} CPUs (other processes skew every figure)")
    if forward_ms is not None:
        print(f"target forward (SmolLM2-135M shape, B = 8, 8 new tokens, 200-token prefix): "
              f"{forward_ms:.1f} ms")
    print(_table(rows, forward_ms))
    if node_rows:
        print(_node_table(node_rows, args.candidates))
    result = {"threads": args.threads, "malloc": "tuned" if tuned else "default", "k": args.k, "vocab": args.vocab, "load_average": load[0],
              "temperature": args.temperature, "repeats": args.repeats, "backends": backends,
              "target_forward_ms": forward_ms, "rows": rows, "node_rows": node_rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
