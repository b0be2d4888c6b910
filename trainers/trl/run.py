"""A TRL GRPO run from a ``TRLConfig``: the dataset, the rewards, the trainer, the report.

``generation: ours`` trains with ``SpeculativeGRPOTrainer`` (our rollouts, TRL's
correction); ``generation: trl`` trains the same job with TRL's own generation (the
baseline). Both time the generation the same way (around TRL's ``_generate``), so their
rollout tokens/s compare. Each logged step goes to ``metrics.jsonl`` under our metric
names, so the summary table and the plots are those of ``make run``; the head's training
round after step s goes into row s there, as ``make run`` writes it (TRL logs it with the
next step, or in its final log after the last step).

Under ``accelerate launch --num_processes N -m scripts.train_trl --config ...`` (on a machine
without CUDA add ``--multi_gpu``, accelerate's torchrun launcher: its ``--cpu`` starts a single
process unless given an MPI hostfile; the processes then join with gloo) each process generates
for its share of the step's prompts (TRL splits the prompts_per_step x num_generations
completions evenly); the logged metrics are means over the processes (TRL's own and ours
alike), and only the main process writes the run's files (metrics.jsonl, summary, plots) and
moves an earlier run's aside, before the others start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainers.grpo.report import MetricsLogger, write_report
from trainers.tasks.arithmetic import make_problems
from trainers.tasks.problems import load_jsonl
from trainers.tasks.rewards import answer_reward, exact_match_reward
from trainers.trl.config import TRLConfig

#: our metric name <- TRL's logged key
METRIC_NAMES = {
    "reward_mean": "reward", "accuracy": "rewards/accuracy/mean", "tau": "speculative/tau",
    "relaxed_frac": "speculative/relaxed_fraction", "kl_k1": "speculative/kl_k1", "kl_k3": "speculative/kl_k3",
    "is_ess": "speculative/is_ess", "is_weight_min": "sampling/importance_sampling_ratio/min",
    "is_weight_mean": "sampling/importance_sampling_ratio/mean",
    "is_weight_max": "sampling/importance_sampling_ratio/max", "rollout_tokens_per_s": "generation/tokens_per_s",
    "rollout_s": "generation/seconds", "loss": "loss", "grad_norm": "grad_norm", "step_s": "step_time",
    "completion_len_mean": "completions/mean_length",
    **{k: f"speculative/{k}" for k in ("drafter_est_tau", "drafter_est_tau_t0", "drafter_est_tau_initial",
                                       "drafter_loss", "drafter_s", "drafter_features_s")},
}


class TimedGeneration:
    """Mixed into a GRPOTrainer: logs the wall time and tokens/s of each ``_generate`` call."""

    def _generate(self, prompts: list):
        from trainers.trl.rollouts import process_mean

        t0 = time.perf_counter()
        out = super()._generate(prompts)
        seconds = time.perf_counter() - t0
        completion_ids = out[1]  # (prompt_ids, completion_ids, ...) in TRL 1.16
        tokens = sum(len(c) for c in completion_ids)
        m = self._metrics["train" if self.model.training else "eval"]
        values = {"seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
        for key, value in process_mean(self.accelerator, values).items():  # each process's, averaged
            m[f"generation/{key}"].append(value)
        return out


class StepLog(TrainerCallback):
    """Writes each logged step to metrics.jsonl (our names) and prints a progress line.

    TRL logs the head's training round (``drafter_*``) with the log after it: the next step's,
    or after the last step its final log (``train_runtime``, no ``loss``). Its metrics go into
    the previous logged step's row, so each row is written when the next log comes (``close``
    writes the last one)."""

    def __init__(self, logger: MetricsLogger, steps: int):
        self.logger, self.steps = logger, steps
        self.held: tuple[int, dict] | None = None  # the last step's row, open for its round's metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        row = {ours: float(logs[theirs]) for ours, theirs in METRIC_NAMES.items() if logs.get(theirs) is not None}
        head = {k: row.pop(k) for k in list(row) if k.startswith("drafter_")}
        if self.held is not None:
            self.held[1].update(head)
        if "loss" not in logs:  # an evaluation's log, or TRL's final one
            return
        self.close()
        self.held = (state.global_step, row)
        line = f"step {state.global_step}/{self.steps}  reward {row.get('reward_mean', 0):.3f}  " \
               f"acc {row.get('accuracy', 0):.2f}  gen tok/s {row.get('rollout_tokens_per_s', 0):.1f}"
        if "tau" in row:
            line += f"  tau {row['tau']:.2f}  relaxed {row.get('relaxed_frac', 0):.2f}  " \
                    f"KL k1 {row.get('kl_k1', 0):.2e} k3 {row.get('kl_k3', 0):.2e}  ESS {row.get('is_ess', 1):.3f}"
        print(line + f"  {row.get('step_s', 0):.1f}s", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Writes the held row (at the next step's log, at the end, or when a run stops)."""
        if self.held is not None:
            self.logger.log(*self.held)
            self.held = None


def build_dataset(cfg: TRLConfig):
    """Conversational prompts with their reference answers (TRL passes ``answer`` to the rewards)."""
    from datasets import Dataset

    n = cfg.run.steps * cfg.task.prompts_per_step
    if cfg.task.source == "jsonl":
        problems = load_jsonl(cfg.task.path)
    else:
        problems = make_problems(n, cfg.task.difficulty, "train", seed=cfg.run.seed)
    rows = []
    for prob in problems:
        messages = [{"role": "user", "content": prob.prompt}]
        if cfg.task.system_prompt:
            messages.insert(0, {"role": "system", "content": cfg.task.system_prompt})
        rows.append({"prompt": messages, "answer": prob.answer})
    return Dataset.from_list(rows)


def reward_functions(cfg: TRLConfig) -> tuple[list, list[float]]:
    """Our answer reward (weight 1) and plain accuracy (weight 0: logged, not trained on)."""
    def _text(c: Any) -> str:
        return c if isinstance(c, str) else c[-1]["content"]

    def reward(completions, answer, **kwargs):
        return [answer_reward(_text(c), a, cfg.reward) for c, a in zip(completions, answer)]

    def accuracy(completions, answer, **kwargs):
        return [exact_match_reward(_text(c), a) for c, a in zip(completions, answer)]

    return [reward, accuracy], [1.0, 0.0]


def build_trainer(cfg: TRLConfig, callbacks: list | None = None, mixins: tuple[type, ...] = ()):
    """The run's trainer: ``SpeculativeGRPOTrainer`` (generation "ours") or TRL's GRPOTrainer,
    timing each generation (``TimedGeneration``), with ``mixins`` (classes overriding trainer
    methods, first in the method order) added."""
    from trl import GRPOTrainer

    from rollout.models import load_target
    from trainers.trl.trainer import SpeculativeGRPOTrainer

    target, tokenizer = load_target(cfg.model.target)
    model = target.model
    args = cfg.grpo_config()
    funcs, weights = reward_functions(cfg)
    args.reward_weights = weights
    common = dict(model=model, reward_funcs=funcs, args=args, train_dataset=build_dataset(cfg),
                  processing_class=tokenizer, callbacks=callbacks)
    if cfg.run.generation == "trl":
        return type("TimedGRPOTrainer", (*mixins, TimedGeneration, GRPOTrainer), {})(**common)
    cls = type("TimedSpeculativeGRPOTrainer", (*mixins, TimedGeneration, SpeculativeGRPOTrainer), {})
    return cls(rollouts=cfg.settings(), correction=cfg.correction, **common)


def fence_previous_outputs(out: Path) -> Path | None:
    """Move an earlier run's outputs in ``out`` aside, whole, to ``out/superseded/<time>/``: ours
    (``run_dir.RUN_OUTPUTS``: metrics.jsonl, rollouts.jsonl, tb/, summary.md, plots/, ...) and
    TRL's checkpoints (``checkpoint-N/``, which the new run's would overwrite or rotate away).
    TRL's own logs (``runs/<time>_<host>/``) are one folder per run and stay. Returns where they
    went (printed), or None if there were none."""
    from trainers.grpo.run_dir import fence_previous_run

    return fence_previous_run(out, "a new run", extra=tuple(sorted(p for p in out.glob("checkpoint-*") if p.is_dir())))


def run(cfg: TRLConfig, mixins: tuple[type, ...] = ()) -> list[dict]:
    """Train ``cfg`` (``build_trainer``, with ``mixins``) and write the report; returns its rows
    (in the main process; the others return [])."""
    from accelerate import PartialState

    out = Path(cfg.run.out_dir)
    args = cfg.grpo_config()  # sets up torch.distributed under accelerate launch
    main = args.process_index == 0
    logger = step_log = None
    if main:  # only the main process writes the run's files
        fence_previous_outputs(out)  # a TRL run starts over: nothing of an earlier one is overwritten
        logger = MetricsLogger(out)
        (out / "metrics.jsonl").write_text("")  # there even if no step gets logged
        step_log = StepLog(logger, cfg.run.steps)
    PartialState().wait_for_everyone()  # the others start once the earlier run's outputs moved aside
    trainer = build_trainer(cfg, callbacks=[step_log] if main else [], mixins=mixins)
    try:
        trainer.train()
    finally:
        if main:
            step_log.close()
            logger.close()
        rollouts = getattr(trainer, "rollouts", None)
        if rollouts is not None:
            rollouts.close()
    if not main:
        return []
    rows, table, plots = write_report(out)
    print("\n" + table, flush=True)
    print(f"\noutputs in {out.resolve()}: metrics.jsonl, summary.md, plots/ "
          f"({', '.join(p.name for p in plots)}), TRL's logs in runs/", flush=True)
    return rows
