"""The rows of ``scripts/bench_rollout.py`` (a helper module of that script, not an entry point):
which configurations a run measures, how each row is labelled and printed, and the engine
options that some rows turn off. A row is ``(mode label, verifier label, spec, verifier, backend)``: spec None
is HF ``generate``; backend None the default engine, an ``Engine`` another one, ``native`` /
``torch`` a pinned verifier backend, an :class:`~rollout.options.EngineOptions` the default
engine's target and head under those options (:func:`engine_with`; the row's label names the
options off, ``EngineOptions.describe``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from rollout.config import ConfigError
from rollout.eagle3 import default_head_path, load_eagle3
from rollout.engine.engine import Engine
from rollout.kernels.quantize import quantize_int8_
from rollout.models import load_embedded_target, round_weights_
from rollout.options import EngineOptions
from rollout.params import SpecConfig, VerifierConfig, tree_spec
from trainers.drift.study import parse_verifier, verifier_label

# the rows' engine options, by the flag of bench_rollout.parse_args that adds them
OPTION_ROWS = {
    "unshared_prefill": EngineOptions(share_prompts=False),  # every row prefilled on its own
    "unfused": EngineOptions(fused=False),  # every module's own forward (the kernel still on)
    "python_layers": EngineOptions(native_layers=False),  # the layers from Python, not csrc/layer.cpp
    "python_draft": EngineOptions(native_draft=False),  # the draft head's forwards from Python
    "draft_steps": EngineOptions(draft_chains=False),  # a sampled chain's steps one C++ call each, not one call
    "fp32_head": EngineOptions(compact_panels=False),  # the weights packed as fp32 panels (the head's were bf16)
    "no_amx": EngineOptions(amx=False),  # bf16-valued weights as compact panels, not AMX tiles
}


def row_configs(args, target, engine: Engine) -> list[tuple]:
    """The rows of one batch size, in run order (the flags of ``bench_rollout.parse_args``)."""
    off, lossless = SpecConfig(mode="off"), VerifierConfig()
    rows = [] if args.no_hf else [("hf generate", "-", None, None, None)]
    rows.append(("off", "lossless", off, lossless, None))
    if args.torch_linear:  # the same target and head, linear layers on torch's GEMM
        gemm = Engine(target, engine.head, num_threads=torch.get_num_threads(), linear="torch")
        rows.append(("off [torch linear]", "lossless", off, lossless, gemm))
    for flag in ("unshared_prefill", "unfused"):  # the autoregressive mode under other options
        if getattr(args, flag):
            options = OPTION_ROWS[flag]
            rows.append((f"off [{options.describe()}]", "lossless", off, lossless, options))
    backends = [b.strip() for b in (args.verifier_backend or "").split(",") if b.strip()] or [None]
    if set(backends) - {None, "native", "torch"}:
        raise SystemExit(f"--verifier-backend: a comma list of native, torch; got {args.verifier_backend!r}")
    pairs = spec_configs(args)
    rows += [(describe(spec) + ("" if be is None else f" [{be}]"), verifier_label(v), spec, v, be)
             for spec, v in pairs for be in backends]
    rounded = args.rounded  # bench_rollout.rounded_engine (--bf16-weights)
    if rounded is not None:
        rows.append(("off [bf16 weights]", "lossless", off, lossless, rounded))
        rows += [(f"{describe(spec)} [bf16 weights]", verifier_label(v), spec, v, rounded) for spec, v in pairs]
    if args.int8 is not None:  # bench_rollout.int8_engine (--int8-head)
        rows += [(f"{describe(spec)} [int8 head]", verifier_label(v), spec, v, args.int8) for spec, v in pairs]
    if args.python_layers:
        rows.append((f"off [{OPTION_ROWS['python_layers'].describe()}]", "lossless", off, lossless,
                     OPTION_ROWS["python_layers"]))
    for flag in ("python_layers", "python_draft", "draft_steps", "fp32_head", "no_amx"):
        if getattr(args, flag):  # each speculative configuration under other options
            options = OPTION_ROWS[flag]
            rows += [(f"{describe(spec)} [{options.describe()}]", verifier_label(v), spec, v, options)
                     for spec, v in pairs]
    return rows


_variants: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {options: its engine}


def engine_with(engine: Engine, options: EngineOptions) -> Engine:
    """An engine over ``engine``'s target and head (the same weights and packed copies) with
    ``options``: made at the first row that asks, then kept with ``engine`` (its planners learn
    across batch sizes, as the default engine's do). The default options: ``engine`` itself."""
    if options == engine.options:
        return engine
    kept = _variants.setdefault(engine, {})
    if options not in kept:
        kept[options] = Engine(engine.target, engine.head, num_threads=torch.get_num_threads(),
                               prefill_tokens=engine.prefill_tokens,
                               linear="native" if engine.use_native_linear else "torch", options=options)
    return kept[options]


def rounded_engine(args, threads: int) -> Engine:
    """``--bf16-weights``' engine: a second copy of the embedded target with its weights rounded to
    bf16 values (the hf backend's ``weights: bfloat16``), and the head loaded for it."""
    target, _ = load_embedded_target()
    round_weights_(target.model, "bfloat16")
    return Engine(target, load_eagle3(args.head or default_head_path(), target), num_threads=threads)


def int8_engine(args, target, threads: int) -> Engine:
    """``--int8-head``'s engine: the same target with a second copy of the head, its linear layers
    rounded to int8 weights (the hf backend's ``drafter_weights: int8``, ``rollout.kernels.quantize``)."""
    head = load_eagle3(args.head or default_head_path(), target)
    quantize_int8_(head)
    return Engine(target, head, num_threads=threads)


def spec_configs(args) -> list[tuple[SpecConfig, VerifierConfig]]:
    specs = []
    for mode in (m for m in args.modes.split(",") if m):
        if mode == "chain":
            specs += [SpecConfig(mode="chain", num_draft_tokens=int(k), draft_sampling=args.draft_sampling)
                      for k in args.chain_k.split(",")]
        elif mode == "tree":
            try:
                specs += [tree_spec(shape) for shape in args.tree.split(";")]
            except (ValueError, ConfigError) as err:
                raise SystemExit(f"--tree: {err}") from None
        else:
            raise SystemExit(f"--modes: unknown mode {mode!r} (allowed: chain, tree)")
    caps = [parse_cap(m.strip().lower()) for m in args.max_batch.split(",") if m.strip()]
    specs = [dataclasses.replace(spec, max_batch=cap, adaptive_k=args.adaptive_k and cap == "auto"
                                 and spec.mode == "chain") for spec in specs for cap in caps or [None]]
    # test=law rows run on chains only (a sampled tree always verifies towards the law: the rule's
    # own row is that row); test=block rows on chains and sampled trees; a top-k tree has neither
    # (no q to verify with; rollout.params.check_test)
    return [(spec, v) for spec in specs for v in parse_verifiers(args.verifiers)
            if not (spec.mode == "tree" and (v.test == "law" or v.test == "block" and not spec.sampled_tree))]


def parse_verifiers(text: str) -> list[VerifierConfig]:
    """``--verifiers``: rule names separated by ',' (default parameters), or specs with parameters
    (``name:key=value,...``, as ``scripts/drift.py`` takes them) separated by ';'."""
    with_params = ";" in text or ":" in text
    try:
        return [parse_verifier(v) for v in verifier_texts(text)]
    except (ValueError, ConfigError) as err:
        hint = " (specs with parameters are separated by ';')" if with_params else ""
        raise SystemExit(f"--verifiers {text!r}: {err}{hint}") from None


def verifier_texts(text: str) -> list[str]:
    """The specs of a ``--verifiers`` list, as written (what :func:`parse_verifiers` parses)."""
    return [v.strip() for v in text.split(";" if ";" in text or ":" in text else ",") if v.strip()]


def parse_cap(text: str) -> int | str | None:
    """A ``spec.max_batch`` value as the benchmarks take it: 'none', 'auto' or a row count."""
    return None if text == "none" else "auto" if text == "auto" else int(text)


def describe(spec: SpecConfig) -> str:
    cap = "" if spec.max_batch is None else f" mb={spec.max_batch}" + ("/k" if spec.adaptive_k else "")
    if spec.mode == "chain":
        return f"chain K={spec.num_draft_tokens} {spec.draft_sampling}{cap}"
    if spec.mode == "tree":
        kind = " sampled" if spec.sampled_tree else ""
        return f"tree d={spec.depth} k={spec.top_k} n={spec.total_tokens}{kind}{cap}"
    return "off"



def plan_line(row: dict) -> str:
    """One line: an auto row's rounds by choice and reason, and each side's tokens per second."""
    p = row["planner"]
    n = max(1, p["rounds"])

    def side(name: str) -> str:
        count = sum(p[name].values())
        reasons = ", ".join(f"{why} {k / n:.1%}" for why, k in sorted(p[name].items(), key=lambda x: -x[1]))
        speed = p["tokens"][name] / p["seconds"][name] if p["seconds"][name] else 0.0
        return f"{name} {count / n:.1%}" + (f" ({reasons}; {speed:.1f} tok/s)" if count else "")

    return f"  planner, batch {row['batch']} {row['mode']} {row['verifier']}: {p['rounds']} rounds; " \
           f"{side('draft')}; {side('plain')}"


def widths(configs: list[tuple]) -> tuple[int, int]:
    """The mode and verifier columns' widths: the longest labels of these rows (at least 27 and 14)."""
    return max(27, *(len(c[0]) for c in configs)), max(14, *(len(c[1]) for c in configs))


def header(width: tuple[int, int] = (27, 14)) -> str:
    return (f"{'batch':>5} {'mode':<{width[0]}} {'verifier':<{width[1]}} {'tok/s':>8} {'tau':>5} {'+-se':>5} "
            f"{'vs AR':>6} {'bound':>6} {'of bd':>6} {'call bd':>7} {'dec AR':>6} {'dec bd':>6} {'len':>5} {'vs HF':>6} "
            f"{'RSS MB':>7}  "
            f"{'paired vs AR':<20}")


def print_row(row: dict, width: tuple[int, int] = (27, 14)) -> None:
    se, ar, bd, of, cbd, dar, dof, hf = (f"{row[k]:.2f}" if row.get(k) is not None else "-" for k in (
        "tau_se", "speedup_vs_ar", "bound", "of_bound", "call_bound", "decode_vs_ar", "decode_of_bound",
        "speedup_vs_hf"))
    p = row.get("paired_vs_ar")
    paired = f"{p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}] n={p['n']}" if p else "-"
    print(f"{row['batch']:>5} {row['mode']:<{width[0]}} {row['verifier']:<{width[1]}} {row['tokens_per_s']:>8.1f} "
          f"{row['tau']:>5.2f} {se:>5} {ar:>6} {bd:>6} {of:>6} {cbd:>7} {dar:>6} {dof:>6} "
          f"{row['length_vs_ar']:>5.2f} {hf:>6} {row['rss_mb']:>7.0f}  {paired}",
          flush=True)
