"""Run GRPO training from one YAML config.

    python -m scripts.train --config configs/default.yaml [--steps N] [--out-dir DIR] [--fresh]
    ray job submit --working-dir . -- "$PWD/.venv/bin/python" -m scripts.train --config X.yaml --out-dir /abs/dir

The config (and, on resume, that it matches the run folder's snapshot) is validated
before Ray or any model starts; a bad field exits with status 2 and one line naming it. A
non-finite loss, gradient or weight stops the run with status 3 before the weights are
broadcast or saved. A checkpoint file that is truncated, corrupt or holds anything but tensors
and plain containers (nothing in it is executed) exits with status 2 and one line naming it. A
run folder whose last checkpoint reached ``run.steps`` is reported complete (its summary shown)
without starting Ray or a model. Without a cluster (no
RAY_ADDRESS, ``ray.address: null``) a local Ray is started and stopped by this process.
Under ``ray job submit --working-dir`` the job runs in a temporary copy that Ray deletes: a
relative out_dir is refused there. One writer per run folder: the run holds ``<out_dir>/.lock``
from before Ray starts to its end (``trainers.grpo.run_lock``), and a second command writing the
same folder (another ``make run``, the same ``ray job submit`` twice) is refused naming the holder.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")  # before torch loads MKL (actors inherit it): fast small matmuls on AMD
# A local Ray starts its workers at nice 15; the rollout actors are the job's main work, so
# they should not yield the CPU to every other process on a shared machine.
os.environ.setdefault("RAY_worker_niceness", "0")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from rollout.config import ConfigError  # noqa: E402

EXIT_CODES = """exit status:
  0  trained (or the run folder was already complete)
  2  a bad config field, a resume that does not belong to this config, a damaged checkpoint file,
     or a run folder another writer holds (one line: error: ...)
  3  a non-finite loss, gradient or weight (stopped before it was broadcast or saved)
  4  a checkpoint could not be written (out of disk space: the folder, bytes needed and free and
     the last good checkpoint are named; the partial one is removed, earlier ones and the logs
     are intact: make space and rerun the same command to resume)"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=EXIT_CODES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training YAML (configs/default.yaml is the embedded default)")
    ap.add_argument("--steps", type=int, help="override run.steps")
    ap.add_argument("--out-dir", help="override run.out_dir")
    ap.add_argument("--fresh", action="store_true",
                    help="start at step 0 (run.resume=false); the old checkpoints move to out_dir/superseded/")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="resume even if seed/model/sampling/verifier/task/loss settings changed (run.allow_config_change)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout.engine.allocator import tune_malloc
    from rollout.models import resolve_device
    from trainers.grpo.config import load_train_config
    from trainers.grpo.preflight import check_local_ray_fits
    from trainers.grpo.run_lock import RunLock, RunLockedError

    tune_malloc()  # the driver computes the GRPO loss over vocabulary-sized logits

    run_over = {k: v for k, v in (("steps", args.steps), ("out_dir", args.out_dir)) if v is not None}
    if args.fresh:
        run_over["resume"] = False
    if args.allow_config_change:
        run_over["allow_config_change"] = True
    try:
        cfg = load_train_config(args.config, {"run": run_over} if run_over else None)
        check_job_out_dir(cfg.run.out_dir)
        resolve_device(cfg.run.device, "run.device")  # the trainer runs in this process: 'cuda' needs a GPU here
        if cfg.ray.address is None and "RAY_ADDRESS" not in os.environ:
            check_local_ray_fits(cfg)  # the local Ray started below
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with RunLock(cfg.run.out_dir, "scripts.train"):  # before Ray: a second writer starts nothing
            return train(cfg)
    except RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def train(cfg) -> int:
    """Resume check, Ray, the training, and the exit status (the run folder's lock held)."""
    from trainers.grpo.run_dir import resume_point

    try:
        ckpt = resume_point(cfg)  # a resume that does not belong to this config is refused here
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run folder: {os.path.abspath(cfg.run.out_dir)}", flush=True)
    if ckpt is not None and finished(ckpt, cfg):
        return 0
    import ray

    from trainers.grpo.checkpoint import CheckpointError, CheckpointWriteError
    from trainers.grpo.guards import NonFiniteError
    from trainers.grpo.loop import GRPOTrainer

    if cfg.ray.address is None and "RAY_ADDRESS" not in os.environ:
        ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    else:
        ray.init(address=cfg.ray.address or "auto")
    try:
        GRPOTrainer(cfg).run()
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except CheckpointError as err:  # a damaged or refused file of the checkpoint resumed from
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointWriteError as err:  # out of disk space (DiskFullError) or another failed write
        print(f"error: {err}", file=sys.stderr)
        return 4
    finally:
        ray.shutdown()
    return 0


def finished(ckpt, cfg) -> bool:
    """Whether the run folder's last checkpoint already reached ``run.steps``: then say so, show the
    run's summary and start nothing (Ray, models)."""
    from trainers.grpo.checkpoint import read_state

    done = int((read_state(ckpt) or {}).get("step", 0))
    if done < cfg.run.steps:
        return False
    print(f"this run is complete: {ckpt} is step {done} of run.steps = {cfg.run.steps}; nothing to train "
          f"(--steps N trains on to step N, --fresh starts over)", flush=True)
    out = Path(cfg.run.out_dir)
    summary, metrics = out / "summary.md", out / "metrics.jsonl"
    if metrics.is_file() and (not summary.is_file() or summary.stat().st_mtime < metrics.stat().st_mtime):
        from trainers.grpo.report import write_report

        write_report(out)  # the run died before writing them
        print("(summary.md and plots/ rebuilt from metrics.jsonl)", flush=True)
    if summary.is_file():
        print("\n" + summary.read_text().rstrip(), flush=True)
    return True


def check_job_out_dir(out_dir: str) -> None:
    """Under ``ray job submit --working-dir`` the job runs in a copy of the working directory
    inside Ray's session folder, deleted with the session: a relative out_dir would put the
    checkpoints there and lose them. Refuse it (exit 2) and ask for an absolute path."""
    if os.path.isabs(os.path.expanduser(out_dir)):
        return
    cwd = os.getcwd()
    if "runtime_resources" in cwd.split(os.sep):
        raise ConfigError("run.out_dir", f"{out_dir!r} is relative, and this Ray job runs in a temporary copy of "
                          f"the working directory ({cwd}) that Ray deletes with its session; give an absolute "
                          "path (e.g. --out-dir /shared/runs/x) so the outputs survive and a resubmission resumes")


if __name__ == "__main__":
    sys.exit(main())
