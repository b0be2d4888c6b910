"""Drift diagnostics: every verifier against its matched baseline, on one prompt set.

    python -m scripts.drift --config configs/drift.yaml
    python -m scripts.drift --quick --out runs/drift_quick          # a smoke run (seconds to a minute)
    python -m scripts.drift --prompts 200 --difficulties 1,2 --modes chain,tree \\
        --verifiers "lossless;mars:theta=0.9;overshoot:lenience=0.5,min_p=0.1;min_p:p_base=0.1"
    python -m scripts.drift --from-run runs/default --out runs/default/drift

Settings come from the defaults of ``trainers.drift.study.DriftConfig``, then ``--config``, then
``configs/drift_quick.yaml`` with ``--quick``, then the flags. Writes ``drift.json``,
``drift.md`` and PNG plots to the output directory (see ``trainers.drift``). ``--from-run``
instead reads a training run's ``rollouts.jsonl`` and plots drift and importance-weight
statistics over the steps. A bad setting exits with status 2 and names the field, and so does
an output directory another command writes (one writer per folder: a run holds
``<out>/.lock`` while it runs, ``trainers.grpo.run_lock``; ``--from-run`` takes none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollout.config import ConfigError, from_dict, load_yaml
from scripts.cli import positive_int

QUICK_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "drift_quick.yaml"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _strs(sep: str):
    return lambda text: [x.strip() for x in text.split(sep) if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", help="YAML with DriftConfig fields (configs/drift.yaml)")
    ap.add_argument("--quick", action="store_true",
                    help=f"overlay {QUICK_CONFIG.name}: a few prompts, short completions")
    ap.add_argument("--prompts", type=int, help="prompts per configuration (split over the difficulties)")
    ap.add_argument("--difficulties", type=_ints, help="task difficulties, e.g. 1,2")
    ap.add_argument("--modes", type=_strs(","), help="speculative modes: chain,tree")
    ap.add_argument("--verifiers", type=_strs(";"), help='";"-separated specs, e.g. "lossless;mars:theta=0.9"')
    ap.add_argument("--source", choices=("tasks", "jsonl", "general"))
    ap.add_argument("--jsonl", dest="jsonl_path", help="problem file for --source jsonl")
    ap.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    ap.add_argument("--batch-size", dest="batch_size", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--target", help="target model folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--head", help="'default' (shipped head), 'random', or a head folder")
    ap.add_argument("--threads", dest="num_threads", type=positive_int, help="torch threads (1 is best on a shared CPU)")
    ap.add_argument("--speed-basis", dest="speed_basis", choices=("wall", "cpu"),
                    help="speedups from wall time or from CPU time of the generate calls")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false", default=None)
    ap.add_argument("--out", "--out-dir", dest="out", help="output directory (--out-dir as in scripts.train)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--from-run", metavar="RUN_DIR", help="plot a training run's rollouts.jsonl instead")
    return ap.parse_args(argv)


FLAG_FIELDS = ("prompts", "difficulties", "modes", "verifiers", "source", "jsonl_path", "max_new_tokens",
               "batch_size", "temperature", "seed", "target", "head", "num_threads", "baselines", "out", "speed_basis")


def build_config(args: argparse.Namespace):
    """DriftConfig from defaults < --config < --quick < flags (raises ConfigError)."""
    from trainers.drift.study import DriftConfig

    data: dict = load_yaml(args.config) if args.config else {}
    if args.quick:
        data.update(load_yaml(QUICK_CONFIG))
    data.update({k: getattr(args, k) for k in FLAG_FIELDS if getattr(args, k) is not None})
    return from_dict(DriftConfig, data)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_run:
        from trainers.drift.report import from_run

        files = from_run(args.from_run, args.out or Path(args.from_run) / "drift")
        print(Path(files[1]).read_text())
        print("wrote " + ", ".join(str(f) for f in files))
        return 0
    try:
        cfg = build_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from trainers.grpo.run_lock import RunLock, RunLockedError

    try:
        with RunLock(cfg.out, "scripts.drift"):
            return study(cfg, args)
    except RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def study(cfg, args: argparse.Namespace) -> int:
    """Run every configuration, then write and print the report (the output folder's lock held)."""
    import dataclasses

    from trainers.drift.report import build_report, markdown_table, write_outputs
    from trainers.drift.run import load_models, run_all

    target, head, tokenizer = load_models(cfg)
    runs = run_all(cfg, target, head, tokenizer, progress=not args.no_progress)
    report = build_report(runs, dataclasses.asdict(cfg))
    files = write_outputs(report, cfg.out, plots=not args.no_plots)
    print(markdown_table(report))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
