"""Held-out evaluation of the policy itself, sampled exactly.

What a run's accuracy means here: the policy pi after n steps, asked held-out problems and
sampled from pi exactly (greedy at T = 0; pi's full distribution at T > 0), never through the
run's lossy verifier, so the settings are compared on what they trained, not on how they sampled.

- **exact sampler**: :func:`exact_generate` is the one way an evaluation generates: our engine
  with plain decoding and the lossless rule, the sampling built here from the temperature alone.
  It then checks the result (:func:`check_exact`): no relaxed token, and every token's behaviour
  log-prob equal to its target log-prob (P = p at every position). A lossy rule anywhere in that
  path fails the check (:class:`InexactEvaluationError`) instead of being recorded.
- **held-out problems**: ``eval.problems_per_difficulty`` per level from the held-out split of
  ``trainers.tasks.arithmetic`` (disjoint from every training problem by construction), drawn with
  ``eval.seed``: the same problems, in the same order, for every run and step.
- **draws**: the sampling seed of batch b is ``eval.seed * 1000 + b`` at every temperature, step
  and run: runs differ only by their policies (common random numbers).
- **when** (:func:`due_steps`): before the first step, every ``eval.every`` steps and after the last.
- **log**: ``<run>/eval.jsonl``, one record per (step, temperature): ``step``, ``temperature``,
  ``key`` (what was evaluated: :func:`eval_key`; the report reads only the current key's records),
  per problem ``ids``, ``difficulty``, ``correct`` (0/1), ``length`` (tokens), and ``accuracy``,
  ``digest`` (of every completion's tokens), ``eval_s``.

:class:`PolicyEvaluator` is ``GRPOTrainer.run``'s ``after_step``: it evaluates the policy in
memory (no checkpoint is written for it); :func:`evaluate_checkpoint` evaluates a saved one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from rollout.chat import chat_ids
from rollout.outputs import GenerationResult
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from trainers.grpo.checkpoint import write_atomic
from trainers.grpo.report import read_jsonl
from trainers.study.config import EvalConfig
from trainers.tasks.arithmetic import make_problems
from trainers.tasks.problems import Problem
from trainers.tasks.rewards import exact_match_reward

EVAL_LOG = "eval.jsonl"
EXACT_SPEC = SpecConfig(mode="off")
EXACT_VERIFIER = VerifierConfig("lossless")
LOGPROB_TOL = 1e-5  # behaviour vs target log-prob of one token (the same float computation when P = p)


class InexactEvaluationError(RuntimeError):
    """An evaluation's tokens did not all come from the policy's own distribution."""


def check_exact(result: GenerationResult) -> None:
    """Raise :class:`InexactEvaluationError` unless every emitted token was sampled from the target
    itself: none relaxed, and each behaviour log-prob equal to the target log-prob (P = p)."""
    for row, c in enumerate(result.completions):
        if any(c.relaxed):
            raise InexactEvaluationError(f"row {row}: {sum(c.relaxed)} token(s) emitted by a relaxed (lossy) branch")
        gaps = [abs(b - t) for b, t in zip(c.behaviour_logprobs, c.target_logprobs)]
        if gaps and max(gaps) > LOGPROB_TOL:
            i = max(range(len(gaps)), key=gaps.__getitem__)
            raise InexactEvaluationError(f"row {row}, token {i}: behaviour log-prob {c.behaviour_logprobs[i]:.6f} != "
                                         f"target log-prob {c.target_logprobs[i]:.6f}: not sampled from the policy")


def exact_generate(engine, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                   stop_token_ids: tuple[int, ...], seed: int) -> GenerationResult:
    """Complete ``prompts`` from the engine's target exactly (plain decoding, lossless, the full
    distribution at ``temperature``), checked by :func:`check_exact`."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    result = engine.generate(prompts, sampling, EXACT_SPEC, EXACT_VERIFIER, seed=seed)
    check_exact(result)
    return result


def heldout_problems(cfg: EvalConfig) -> list[Problem]:
    """The held-out problems: ``problems_per_difficulty`` of each level, level by level."""
    n = cfg.problems_per_difficulty
    return [p for d in cfg.difficulties for p in make_problems(n, d, "heldout", seed=cfg.seed)]


def due_steps(steps: int, every: int) -> list[int]:
    """The steps evaluated in a run of ``steps``: 0, every ``every``-th, and ``steps``."""
    due = {0, steps} | ({k for k in range(every, steps + 1, every)} if every else set())
    return sorted(due)


def eval_key(cfg: EvalConfig, temperature: float, max_new_tokens: int) -> str:
    """What an evaluation record measured (problems, sampling, batching), as a short digest."""
    what = {**asdict(cfg), "every": None, "temperatures": None, "temperature": temperature,
            "max_new_tokens": max_new_tokens}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def evaluate_policy(engine, tokenizer, problems: list[Problem], cfg: EvalConfig, step: int, max_new_tokens: int,
                    system_prompt: str | None = None) -> list[dict]:
    """One record per temperature (see the module docstring) for the engine's target at ``step``."""
    prompts = [chat_ids(tokenizer, p.prompt, system=system_prompt) for p in problems]
    stops = (tokenizer.eos_token_id,)
    records = []
    for temperature in cfg.temperatures:
        t0 = time.perf_counter()
        completions = []
        for b, start in enumerate(range(0, len(prompts), cfg.batch_size)):
            result = exact_generate(engine, prompts[start:start + cfg.batch_size], temperature, max_new_tokens,
                                    stops, seed=cfg.seed * 1000 + b)
            completions += result.completions
        texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
        correct = [int(exact_match_reward(t, p.answer) >= 1.0) for t, p in zip(texts, problems)]
        digest = hashlib.sha256(json.dumps([c.completion_ids for c in completions]).encode()).hexdigest()[:16]
        records.append({"step": step, "temperature": temperature, "key": eval_key(cfg, temperature, max_new_tokens),
                        "ids": [p.id for p in problems], "difficulty": [p.difficulty for p in problems],
                        "correct": correct, "length": [c.num_tokens for c in completions],
                        "accuracy": sum(correct) / max(len(correct), 1), "digest": digest,
                        "eval_s": time.perf_counter() - t0})
    return records


class EvalLog:
    """A run's ``eval.jsonl``: appended record by record, cut back to a resume point."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVAL_LOG

    def records(self) -> list[dict]:
        return read_jsonl(self.path) if self.path.is_file() else []

    def append(self, records: list[dict]) -> None:
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def truncate_after(self, step: int) -> None:
        """Keep the records up to ``step`` (the step a run starts or resumes from)."""
        if self.path.is_file():
            keep = [r for r in self.records() if r["step"] <= step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def done_steps(self, keys: set[str]) -> set[int]:
        """The steps that have a record for every key in ``keys`` (every temperature)."""
        seen: dict[int, set[str]] = {}
        for r in self.records():
            seen.setdefault(r["step"], set()).add(r.get("key"))
        return {s for s, k in seen.items() if keys <= k}


def eval_keys(cfg: EvalConfig, max_new_tokens: int) -> set[str]:
    return {eval_key(cfg, t, max_new_tokens) for t in cfg.temperatures}


def resolved_max_new_tokens(cfg: EvalConfig, train) -> int:
    """``eval.max_new_tokens``, or the run's rollout cap when it is null."""
    return cfg.max_new_tokens or train.rollout.sampling.max_new_tokens


class PolicyEvaluator:
    """``GRPOTrainer.run``'s ``after_step``: at each due step without its records, the held-out
    evaluation of the trainer's policy as it is in memory, appended to the run's ``eval.jsonl``.
    Its first call (the step the run starts from) cuts the log back to that step. ``report(step,
    records)`` is told of each evaluation."""

    def __init__(self, cfg: EvalConfig, train, report=None):
        self.cfg, self.train = cfg, train
        self.log = EvalLog(train.run.out_dir)
        self.problems = heldout_problems(cfg)
        self.max_new_tokens = resolved_max_new_tokens(cfg, train)
        self.keys = eval_keys(cfg, self.max_new_tokens)
        self.due = set(due_steps(train.run.steps, cfg.every))
        self.report = report
        self.engine = None

    def __call__(self, trainer, step: int) -> None:
        if self.engine is None:
            from rollout.engine.engine import Engine

            self.log.truncate_after(step)
            self.engine = Engine(trainer.policy_target, None)  # the trainer's own model object
        if step not in self.due or step in self.log.done_steps(self.keys):
            return
        records = evaluate_policy(self.engine, trainer.tokenizer, self.problems, self.cfg, step, self.max_new_tokens,
                                  self.train.task.system_prompt)
        self.log.append(records)
        if self.report is not None:
            self.report(step, records)


def evaluate_checkpoint(ckpt: str | Path, cfg: EvalConfig, train) -> list[dict]:
    """The held-out evaluation of a saved policy (``<run>/checkpoints/step_N``), as the run's own
    evaluation of step N would have recorded it."""
    from rollout.engine.engine import Engine
    from rollout.models import load_target, resolve_device
    from trainers.grpo.checkpoint import read_policy

    target, tokenizer = load_target(train.model.target)
    weights, state = read_policy(Path(ckpt))
    target.model.load_state_dict(weights)
    target.to(resolve_device(train.run.device, "run.device"))
    return evaluate_policy(Engine(target, None), tokenizer, heldout_problems(cfg), cfg, int(state["step"]),
                           resolved_max_new_tokens(cfg, train), train.task.system_prompt)
