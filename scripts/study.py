"""Train and report the lossy-verification study: a grid of GRPO runs (settings x seeds), each
evaluated on held-out problems by sampling its policy exactly, and one report.

    python -m scripts.study --config configs/study_quick.yaml                   # this machine, ~1 hour
    python -m scripts.study --config configs/study.yaml                         # a GPU Ray cluster
    python -m scripts.study --config configs/study_quick.yaml --report-only     # the report from the folders
    python -m scripts.study --config configs/study_quick.yaml --settings lossless,mars_tis --seeds 0 \\
        --steps 1 --eval-problems 4 --out-dir runs/study_smoke                  # a smoke run

Every run is a GRPO run folder ``<study.out_dir>/runs/<setting>/seed<k>/`` (``scripts.compare_runs``
reads it). Running the same command again skips finished runs and resumes an interrupted one from
its checkpoint. The report is ``<study.out_dir>/study.md`` (with ``study.json`` and ``plots/``).
The whole config, every run's GRPO config and every run folder's resume check are validated before
Ray or a model starts. The study folder is held by one writer at a time (``.lock``), as is each run
folder while it trains. See docs/study.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")  # before torch loads MKL (actors inherit it): fast small matmuls on AMD
os.environ.setdefault("RAY_worker_niceness", "0")  # the rollout actors are the job's main work

import argparse  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402

from rollout.config import ConfigError  # noqa: E402
from scripts.cli import positive_int  # noqa: E402

EXIT_CODES = """exit status:
  0  every run finished (or was finished before); the report is written
  1  some run failed (named above; the others went on); the report covers the finished ones
  2  a bad config field, a run folder that belongs to another config, or a folder another writer
     holds (one line: error: ...)
  4  a checkpoint could not be written (out of disk space): the study stopped; make space and rerun"""


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must be a comma list of names, got {text!r}")
    return names


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}") from None
    if min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be >= 0, got {text!r}")
    return seeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EXIT_CODES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="study YAML (configs/study_quick.yaml, configs/study.yaml)")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the report from the run folders")
    ap.add_argument("--settings", type=_names, help="comma list: only these settings (must include the reference)")
    ap.add_argument("--seeds", type=_seeds, help="comma list: override study.seeds")
    ap.add_argument("--steps", type=positive_int, help="override train.run.steps")
    ap.add_argument("--eval-problems", type=positive_int, help="override eval.problems_per_difficulty")
    ap.add_argument("--out-dir", help="override study.out_dir")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trainers.grpo.run_dir import resume_point
    from trainers.grpo.run_lock import RunLock, RunLockedError
    from trainers.study.config import load_study_config
    from trainers.study.grid import plan_runs
    from trainers.study.report import write_report
    from trainers.study.runner import check_out_dir, check_parallel_fits

    command = "python -m scripts.study " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_study_config(args.config, settings=args.settings, seeds=args.seeds, steps=args.steps,
                                out_dir=args.out_dir, eval_problems=args.eval_problems)
        plans = plan_runs(cfg)
        if not args.report_only:
            for plan in plans:
                resume_point(plan.config)  # a run folder of another config is refused here, before anything starts
            check_out_dir(cfg, plans)
            check_parallel_fits(cfg, plans)
            train = plans[0].config
            if cfg.study.parallel == 1 and train.ray.address is None and "RAY_ADDRESS" not in os.environ:
                from trainers.grpo.preflight import check_local_ray_fits

                for plan in plans:
                    check_local_ray_fits(plan.config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"study folder: {os.path.abspath(cfg.study.out_dir)} ({len(cfg.settings)} settings x "
          f"{len(cfg.study.seeds)} seeds = {len(plans)} runs)", flush=True)
    failed = 0
    try:
        with RunLock(cfg.study.out_dir, "scripts.study"):
            if not args.report_only:
                failed = _train(cfg, plans)
                if failed is None:
                    return 4
            md, js, plots = write_report(cfg, plans, command)
    except RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\nreport: {md} ({js.name}, plots/: {', '.join(p.name for p in plots)})", flush=True)
    print(md.read_text().split("## Final held-out accuracy")[0].rstrip(), flush=True)
    return 1 if failed else 0


def _train(cfg, plans) -> int | None:
    """Run the study; the number of failed runs, or None when it stopped out of disk space."""
    from trainers.grpo.checkpoint import CheckpointWriteError
    from trainers.study.runner import run_study

    try:
        outcomes = run_study(cfg, plans)
    except CheckpointWriteError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"failed: {o.plan.label} ({o.plan.out_dir}): {o.error}", file=sys.stderr)
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
