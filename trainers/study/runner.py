"""Training the study's grid: one run after another in this process, or as parallel Ray tasks.

- **state of a run** (:func:`run_state`): ``done`` (its last checkpoint reached ``run.steps`` and
  its final evaluation is recorded: skipped, nothing starts), ``evaluate`` (trained, the final
  evaluation missing: done from the saved policy), ``resume`` (a checkpoint short of
  ``run.steps``: the GRPO job's own resume, ``trainers.grpo.run_dir``) or ``new``.
- **a run** (:func:`work`): the GRPO job (``GRPOTrainer.run``) with the held-out evaluation as its
  ``after_step`` (``trainers.study.evaluate.PolicyEvaluator``), holding its folder's lock
  (``trainers.grpo.run_lock``). A run that fails (a non-finite loss, a damaged checkpoint, a
  crash) is reported and the next one starts; out of disk space stops the study.
- **sequential** (``study.parallel: 1``): this process trains each run, on one Ray (local, or the
  cluster of ``train.ray.address``) started once for the study.
- **parallel** (``study.parallel: N`` > 1): each run is a Ray task reserving ``study.cpus_per_run``
  CPUs and ``study.gpus_per_run`` GPUs for its trainer (its rollout actors reserve their own); at
  most N run at once. On a local Ray every task and its actors must fit together
  (:func:`check_parallel_fits`), or tasks holding CPUs would wait for ever for their actors'.
- **progress**: a line per step, ``[3/20] mars_tis seed 1: step 4/8 ...``, with the held-out
  accuracy where the step was evaluated and the study's ETA (:func:`eta_seconds`).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from rollout.config import ConfigError
from trainers.study.config import StudyConfig
from trainers.study.evaluate import (EvalLog, PolicyEvaluator, due_steps, eval_keys, evaluate_checkpoint,
                                     resolved_max_new_tokens)
from trainers.study.grid import RunPlan

STATES = ("done", "evaluate", "resume", "new")


@dataclass(frozen=True)
class Outcome:
    """What became of one run: ``skipped`` (done before), ``trained``, ``evaluated`` (its missing
    evaluations from checkpoints) or ``failed`` (``error`` says why); its wall seconds."""

    plan: RunPlan
    status: str
    seconds: float = 0.0
    error: str | None = None


# ----------------------------------------------------------------------------- state
def _checkpoints(plan: RunPlan) -> dict[int, object]:
    """The run's complete checkpoints by step."""
    from trainers.grpo.checkpoint import read_state

    root = plan.out_dir / "checkpoints"
    out = {}
    if root.is_dir():
        for p in root.iterdir():
            state = read_state(p) if p.is_dir() and p.name.startswith("step_") and "." not in p.name else None
            if state is not None:
                out[int(state["step"])] = p
    return out


def run_state(plan: RunPlan, cfg: StudyConfig) -> str:
    """One of :data:`STATES` (see the module docstring), from the run folder alone."""
    ckpts = _checkpoints(plan)
    steps = plan.config.run.steps
    if not ckpts:
        return "new"
    if max(ckpts) < steps:
        return "resume"
    keys = eval_keys(cfg.eval, resolved_max_new_tokens(cfg.eval, plan.config))
    return "done" if steps in EvalLog(plan.out_dir).done_steps(keys) else "evaluate"


def evaluate_missing(plan: RunPlan, cfg: StudyConfig) -> list[int]:
    """Evaluate, from its checkpoints, every due step of a trained run that has a checkpoint and no
    evaluation; returns those steps. A due step with neither stays missing (named in the report)."""
    steps = plan.config.run.steps
    log = EvalLog(plan.out_dir)
    done = log.done_steps(eval_keys(cfg.eval, resolved_max_new_tokens(cfg.eval, plan.config)))
    ckpts = _checkpoints(plan)
    if steps not in ckpts:
        raise RuntimeError(f"{plan.out_dir}: no checkpoint of step {steps} to evaluate (its newest is step "
                           f"{max(ckpts)}): run it with run.steps {max(ckpts)}, or move its checkpoints aside to "
                           "retrain")
    todo = [s for s in due_steps(steps, cfg.eval.every) if s not in done and s in ckpts]
    for s in todo:
        log.append(evaluate_checkpoint(ckpts[s], cfg.eval, plan.config))
    return todo


# ----------------------------------------------------------------------------- one run
def _accuracies(records: list[dict]) -> str:
    return " ".join(f"T={r['temperature']:g} {r['accuracy']:.3f}" for r in records)


Progress = Callable[[int, str], None]  # (step, its progress line)


def train_run(plan: RunPlan, cfg: StudyConfig, progress: Progress) -> None:
    """Train (or resume) one run with its held-out evaluation, its folder locked; ``progress`` gets
    each step and its line."""
    from trainers.grpo.loop import GRPOTrainer
    from trainers.grpo.run_lock import RunLock

    steps, t0 = plan.config.run.steps, time.perf_counter()
    evaluated: dict[int, list[dict]] = {}
    evaluator = PolicyEvaluator(cfg.eval, plan.config, report=lambda step, recs: evaluated.__setitem__(step, recs))

    def after_step(trainer, step: int) -> None:
        evaluator(trainer, step)
        held = f"  held-out {_accuracies(evaluated[step])}" if step in evaluated else ""
        progress(step, f"[{plan.index}/{plan.total}] {plan.label}: step {step}/{steps}{held}  "
                       f"({(time.perf_counter() - t0) / 60:.1f} min in this run)")

    with RunLock(plan.out_dir, "scripts.study"):
        trainer = GRPOTrainer(plan.config)
        try:
            trainer.run(after_step=after_step)
        finally:
            del trainer, evaluator
            gc.collect()


def work(plan: RunPlan, cfg: StudyConfig, progress: Progress) -> str:
    """Bring one run to done: ``skipped``, ``evaluated`` or ``trained`` (a failure raises)."""
    from trainers.grpo.run_lock import RunLock

    state = run_state(plan, cfg)
    if state == "done":
        return "skipped"
    if state == "evaluate":
        with RunLock(plan.out_dir, "scripts.study"):
            steps = evaluate_missing(plan, cfg)
        progress(plan.config.run.steps, f"[{plan.index}/{plan.total}] {plan.label}: trained before; evaluated "
                 f"step(s) {steps} from checkpoints")
        return "evaluated"
    train_run(plan, cfg, progress)
    return "trained"


def _task(plan: RunPlan, cfg: StudyConfig) -> tuple[str, float]:
    """One run inside a Ray task (parallel mode): its status and wall seconds."""
    t0 = time.perf_counter()
    status = work(plan, cfg, lambda step, line: print(line, flush=True))
    return status, time.perf_counter() - t0


# ----------------------------------------------------------------------------- the study
def eta_seconds(durations: list[float], remaining: float, parallel: int,
                current: tuple[float, float] | None = None) -> float | None:
    """Seconds left for ``remaining`` runs (the current one counted whole), ``parallel`` at a time:
    the mean duration of the runs finished so far, or, before any, the current run's pace
    (``current`` = (seconds in it, fraction done)); None when neither is known."""
    if durations:
        per_run = sum(durations) / len(durations)
    elif current is not None and current[1] > 0:
        per_run = current[0] / current[1]
    else:
        return None
    done_now = current[1] if current is not None else 0.0
    return max(0.0, (remaining - done_now) * per_run / max(parallel, 1))


def _minutes(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds / 60:.1f} min"


def check_parallel_fits(cfg: StudyConfig, plans: list[RunPlan]) -> None:
    """Refuse (ConfigError) a parallel study whose tasks cannot all start on the local Ray, or whose
    trainers need a GPU their tasks do not reserve."""
    if cfg.study.parallel < 2 or not plans:
        return
    train = plans[0].config
    if train.run.device == "cuda" and cfg.study.gpus_per_run < 1:
        raise ConfigError("study.gpus_per_run", "each run's trainer runs on cuda (train.run.device): its task "
                          f"needs a GPU, got {cfg.study.gpus_per_run:g}")
    if train.ray.address is not None or "RAY_ADDRESS" in os.environ:
        return  # a cluster: Ray queues what does not fit now
    cpus = train.ray.num_cpus or os.cpu_count() or 1
    r = train.rollout
    per_run = cfg.study.cpus_per_run + r.num_actors * r.threads_per_actor
    if per_run > cpus:
        raise ConfigError("study.cpus_per_run", f"a run needs {per_run:g} CPUs (its task {cfg.study.cpus_per_run:g} "
                          f"+ {r.num_actors} actor(s) x {r.threads_per_actor} threads); the local Ray has {cpus} "
                          "(train.ray.num_cpus)")
    if cfg.study.parallel * per_run > cpus:
        raise ConfigError("study.parallel", f"{cfg.study.parallel} runs at once need {cfg.study.parallel * per_run:g} "
                          f"CPUs (each {per_run:g}); the local Ray has {cpus} (train.ray.num_cpus): tasks holding "
                          f"CPUs would wait for ever for their actors'; at most {int(cpus // per_run)}")


def check_out_dir(cfg: StudyConfig, plans: list[RunPlan]) -> None:
    """Refuse (ConfigError) a relative ``study.out_dir`` where it would not be one folder: parallel
    runs on a cluster (each task would write under its own node's working directory), or a job run
    by ``ray job submit --working-dir`` (a temporary copy Ray deletes with its session)."""
    out = os.path.expanduser(cfg.study.out_dir)
    if os.path.isabs(out) or not plans:
        return
    train = plans[0].config
    cluster = train.ray.address is not None or "RAY_ADDRESS" in os.environ
    if cluster and cfg.study.parallel > 1:
        raise ConfigError("study.out_dir", f"{out!r} is relative, and the runs are Ray tasks on the cluster's nodes, "
                          "each writing under its own working directory; give an absolute path on storage every node "
                          "shares (--out-dir /shared/studies/x)")
    if "runtime_resources" in os.getcwd().split(os.sep):
        raise ConfigError("study.out_dir", f"{out!r} is relative, and this Ray job runs in a temporary copy of the "
                          f"working directory ({os.getcwd()}) that Ray deletes with its session; give an absolute path "
                          "(--out-dir /shared/studies/x) so the runs survive and a resubmission resumes")


def _start_ray(train):
    """Ray for the study (None if one is already up in this process, e.g. a test's)."""
    import ray

    if ray.is_initialized():
        return None
    if train.ray.address is None and "RAY_ADDRESS" not in os.environ:
        ray.init(address="local", num_cpus=train.ray.num_cpus, include_dashboard=False)
    else:
        ray.init(address=train.ray.address or "auto")
    return ray


def run_study(cfg: StudyConfig, plans: list[RunPlan], say: Callable[[str], None] = print) -> list[Outcome]:
    """Bring every run of ``plans`` to done (see the module docstring); returns their outcomes."""
    outcomes: list[Outcome] = []
    todo = []
    for plan in plans:
        state = run_state(plan, cfg)
        if state == "done":
            say(f"[{plan.index}/{plan.total}] {plan.label}: done before (final checkpoint and evaluation), skipped")
            outcomes.append(Outcome(plan, "skipped"))
        else:
            todo.append(plan)
    if not todo:
        return outcomes
    started = _start_ray(plans[0].config)
    try:
        runner = _sequential if cfg.study.parallel == 1 else _parallel
        outcomes += runner(cfg, todo, say)
    finally:
        if started is not None:
            started.shutdown()
    return sorted(outcomes, key=lambda o: o.plan.index)


def _sequential(cfg: StudyConfig, todo: list[RunPlan], say) -> list[Outcome]:
    from trainers.grpo.checkpoint import CheckpointWriteError

    outcomes, durations = [], []
    for i, plan in enumerate(todo):
        t0 = time.perf_counter()
        steps = plan.config.run.steps

        def progress(step: int, line: str, t0=t0, i=i, steps=steps) -> None:  # the line, with the study's ETA
            eta = eta_seconds(durations, len(todo) - i, 1, (time.perf_counter() - t0, step / steps))
            say(f"{line}  | study ETA {_minutes(eta)}")
        try:
            status = work(plan, cfg, progress)
        except CheckpointWriteError:
            raise  # out of disk space (or another write error): the next runs would fail the same way
        except Exception as err:  # noqa: BLE001 - one run failing does not stop the study
            traceback.print_exc()
            say(f"[{plan.index}/{plan.total}] {plan.label}: FAILED ({type(err).__name__}: {err}); going on")
            outcomes.append(Outcome(plan, "failed", time.perf_counter() - t0, f"{type(err).__name__}: {err}"))
            continue
        seconds = time.perf_counter() - t0
        if status == "trained":
            durations.append(seconds)
        outcomes.append(Outcome(plan, status, seconds))
        say(f"[{plan.index}/{plan.total}] {plan.label}: {status} in {seconds / 60:.1f} min; "
            f"{len(todo) - i - 1} run(s) left, ETA {_minutes(eta_seconds(durations, len(todo) - i - 1, 1))}")
    return outcomes


def _parallel(cfg: StudyConfig, todo: list[RunPlan], say) -> list[Outcome]:
    import ray

    task = ray.remote(_task)
    queue, pending, outcomes, durations = list(todo), {}, [], []
    while queue or pending:
        while queue and len(pending) < cfg.study.parallel:
            plan = queue.pop(0)
            ref = task.options(num_cpus=cfg.study.cpus_per_run, num_gpus=cfg.study.gpus_per_run,
                               max_retries=0).remote(plan, cfg)
            pending[ref] = (plan, time.perf_counter())
            say(f"[{plan.index}/{plan.total}] {plan.label}: started as a Ray task")
        ready, _ = ray.wait(list(pending), num_returns=1)
        plan, t0 = pending.pop(ready[0])
        try:
            status, seconds = ray.get(ready[0])
        except Exception as err:  # noqa: BLE001 - a failed task (its error) does not stop the others
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            say(f"[{plan.index}/{plan.total}] {plan.label}: FAILED ({reason}); going on")
            outcomes.append(Outcome(plan, "failed", time.perf_counter() - t0, reason))
            continue
        if status == "trained":
            durations.append(seconds)
        outcomes.append(Outcome(plan, status, seconds))
        left = len(queue) + len(pending)
        say(f"[{plan.index}/{plan.total}] {plan.label}: {status} in {seconds / 60:.1f} min; {left} run(s) left, "
            f"ETA {_minutes(eta_seconds(durations, left, cfg.study.parallel))}")
    return outcomes
