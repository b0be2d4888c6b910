"""TRL GRPO with our speculative rollouts, from one YAML config.

    python -m scripts.train_trl --config configs/trl.yaml [--steps N] [--out-dir DIR]
        [--generation ours|trl] [--verifier NAME] [--spec-mode off|chain|tree]

The config is validated before any model loads (the ``trl`` arguments by building TRL's
``GRPOConfig`` from them, the task file and the head as ``scripts.train`` checks them); a bad
field exits with status 2 and a message naming it, and nothing in ``run.out_dir`` is touched.
A run then first moves an earlier run's outputs in ``run.out_dir`` (metrics.jsonl, tb/,
summary.md, plots/, TRL's checkpoint-N/, ...) to ``<out_dir>/superseded/<time>/``.
``rollout.placement: ray`` generates in our Ray actor pool, each actor loading
``model.target`` (Ray as ``ray.init()`` finds it: ``RAY_ADDRESS``, a ``ray start`` cluster,
else a new local one). ``--generation trl`` trains the same job with TRL's own generation;
``--verifier lossless`` / ``--spec-mode off`` give the other columns of a side-by-side run.
``--spec-mode tree`` drafts top-k trees, whose candidates are not sampled from q: with
``configs/trl.yaml``'s MARS ``test: law`` it is refused (say ``verifier.test: rule``, or
``spec.tree_candidates: sampled``). One writer per run folder: the main process holds
``<out_dir>/.lock`` for the run (``trainers.grpo.run_lock``); a second command writing the same
folder is refused naming the holder.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")  # before torch loads MKL: fast small matmuls on AMD
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16

import argparse  # noqa: E402
import sys  # noqa: E402

from rollout.config import ConfigError  # noqa: E402

EXIT_CODES = """exit status:
  0  trained
  2  a bad config field (trl arguments included, checked before any model loads), or a run
     folder another writer holds (one line: error: ...)
  4  a checkpoint could not be written (out of disk space: the folder, bytes needed and free and
     the last complete checkpoint are named; the partial checkpoint-N is removed)"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=EXIT_CODES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="TRL run YAML (configs/trl.yaml)")
    ap.add_argument("--steps", type=int, help="override run.steps")
    ap.add_argument("--out-dir", help="override run.out_dir")
    ap.add_argument("--generation", choices=["ours", "trl"], help="override run.generation")
    ap.add_argument("--verifier", help="override rollout.verifier.name (its params are dropped)")
    ap.add_argument("--spec-mode", choices=["off", "chain", "tree"], help="override rollout.spec.mode")
    return ap.parse_args(argv)


def overrides(args: argparse.Namespace) -> dict:
    run = {k: v for k, v in (("steps", args.steps), ("out_dir", args.out_dir), ("generation", args.generation))
           if v is not None}
    rollout: dict = {}
    if args.verifier:
        rollout["verifier"] = {"name": args.verifier, "params": {}}
    if args.spec_mode:
        rollout["spec"] = {"mode": args.spec_mode}
    return {k: v for k, v in (("run", run), ("rollout", rollout)) if v}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout.engine.allocator import tune_malloc
    from trainers.trl.config import load_trl_config

    tune_malloc()
    try:
        cfg = load_trl_config(args.config, overrides(args))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import contextlib

    from trainers.grpo.checkpoint import CheckpointWriteError
    from trainers.grpo.run_lock import RunLock
    from trainers.trl.run import run

    main_process = os.environ.get("RANK", "0") == "0"  # under accelerate launch only the main process writes
    try:
        with RunLock(cfg.run.out_dir, "scripts.train_trl") if main_process else contextlib.nullcontext():
            run(cfg)
    except ConfigError as err:  # the folder held by another writer (RunLockedError), or a setting TRL cannot honour
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointWriteError as err:  # out of disk space (DiskFullError) or another failed write
        print(f"error: {err}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
