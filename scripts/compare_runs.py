"""Compare training runs side by side: config differences, metrics per window of steps, a figure.

    python -m scripts.compare_runs runs/exact runs/bf16 [--labels exact,bf16] [--window 5]
        [--metrics reward_mean,accuracy,is_ess] [--out runs/compare]

    python -m scripts.compare_runs runs/exact_s0 runs/exact_s1 runs/bf16_s0 runs/bf16_s1 \\
        --labels exact,exact,bf16,bf16        # runs sharing a label: one setting, several seeds

Each argument is a training run's out_dir (``metrics.jsonl``, ``config.json``). Runs given
the same label are grouped: their mean with the range [min-max], and a band in the figure.
Prints the comparison as Markdown; with ``--out`` also writes ``comparison.md`` and
``comparison.png`` there. A folder without metrics, an unknown metric or a label count that
does not match the runs exits with status 2 and says which.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.grpo.compare import DEFAULT_METRICS, comparison_markdown, labels_for, load_run, plot_comparison


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="training run folders (run.out_dir)")
    ap.add_argument("--labels", type=_names,
                    help="comma-separated names for the runs; a repeated name groups runs (default: folder names)")
    ap.add_argument("--window", type=int, default=5, help="steps per table row (default 5)")
    ap.add_argument("--metrics", type=_names, default=[k for k, _, _ in DEFAULT_METRICS],
                    help="comma-separated metrics.jsonl keys (default: " + ",".join(k for k, _, _ in DEFAULT_METRICS) + ")")
    ap.add_argument("--out", help="folder for comparison.md and comparison.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.window < 1:
            raise ValueError(f"--window must be >= 1, got {args.window}")
        runs = [load_run(p, label) for p, label in zip(args.runs, labels_for(args.runs, args.labels))]
        text = comparison_markdown(runs, args.metrics, args.window)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(text)
        png = plot_comparison(runs, args.metrics, out / "comparison.png")
        print(f"\nwrote {out / 'comparison.md'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
