"""The GRPO training driver: Ray rollout actors, reward, corrected loss, weight broadcast.

One step:
1. take ``prompts_per_step`` problems (derived from (seed, step)), repeat each
   ``group_size`` times, shard them over the rollout actors;
2. the actors generate with speculation under the configured verifier and return each
   token's behaviour log-prob (the true sampling log-prob) and the policy version;
3. score completions, compute group-relative advantages;
4. recompute log pi_old of every token with the trainer's policy, build importance
   weights pi_old / P (truncated or masked, per token or per sequence), apply the
   clipped policy-gradient loss (one optimizer step per batch), log drift;
5. broadcast the new weights (version + 1); with ``drafter_training.every``, train the EAGLE-3
   head on this step's sequences under the new policy and ship it to the actors
   (``trainers/grpo/online_drafter.py``); checkpoint and log.

Simplification: one gradient step per rollout batch, so the PPO ratio is 1 at the step
and the clipping is inactive; the off-policy weights carry the whole correction.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rollout.backend import WorkerSpec
from rollout.chat import chat_ids
from rollout.models import load_target, resolve_device
from rollout.outputs import RolloutBatch
from rollout.ray.actor_pool import RolloutPool
from trainers.grpo.checkpoint import load_checkpoint, load_state, save_checkpoint
from trainers.grpo.config import TrainConfig
from trainers.grpo.correction import importance_weights
from trainers.grpo.forward_plan import ForwardCost, micro_batches
from trainers.grpo.guards import check_loss_and_grad, check_weights
from trainers.grpo.loss import group_advantages, policy_loss
from trainers.grpo.metrics import relaxed_fraction, reward_stats
from trainers.grpo.online_drafter import STATE_FILE, STATE_KEYS, OnlineDrafter
from trainers.grpo.policy import completion_logprobs, forward_paths
from trainers.grpo.report import MetricsLogger, write_report
from trainers.grpo.run_dir import prepare_run_dir
from trainers.tasks.arithmetic import make_problems
from trainers.tasks.problems import Problem, load_jsonl
from trainers.tasks.rewards import answer_reward, exact_match_reward

log = logging.getLogger(__name__)

StepHook = Callable[["GRPOTrainer", int], None]  # GRPOTrainer.run's after_step


class ProblemSource:
    """The problems of step n, a pure function of (seed, step)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.pool = load_jsonl(cfg.task.path) if cfg.task.source == "jsonl" else None

    def for_step(self, step: int) -> list[Problem]:
        n, seed = self.cfg.task.prompts_per_step, self.cfg.run.seed * 100_003 + step
        if self.pool is None:
            return make_problems(n, self.cfg.task.difficulty, "train", seed=seed)
        return random.Random(seed).sample(self.pool, min(n, len(self.pool)))


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out_dir = Path(cfg.run.out_dir)
        self.policy_target, self.tokenizer = load_target(cfg.model.target)
        self.device = resolve_device(cfg.run.device, "run.device")
        self.policy = self.policy_target.model.to(self.device)
        self.policy.eval()  # no dropout; gradients still flow
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=o.betas,
                                           weight_decay=o.weight_decay)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False) if cfg.grpo.kl_coef > 0 else None
        self.problems = ProblemSource(cfg)
        self.stop_ids = tuple(sorted(set(cfg.rollout.sampling.stop_token_ids) | {self.tokenizer.eos_token_id}))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.start_step, self.version = 0, 0
        self.pool: RolloutPool | None = None
        self.drafter: OnlineDrafter | None = None  # the head trained with the policy (drafter_training)

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        ckpt = prepare_run_dir(self.cfg)
        if ckpt is not None:
            state = load_checkpoint(ckpt, self.policy, self.optimizer)
            self.start_step, self.version = state["step"], state["version"]
            print(f"resumed from {ckpt} (step {self.start_step})", flush=True)
        self.logger = MetricsLogger(self.out_dir, resume_step=self.start_step)
        r = self.cfg.rollout
        sampling = dataclasses.replace(r.sampling, stop_token_ids=self.stop_ids)
        drafter = self.cfg.model.drafter_path()
        trained = ckpt is not None and (ckpt / f"{STATE_FILE}.pt").is_file()  # the head as trained so far
        if self.cfg.drafter_training.enabled:
            self.drafter = OnlineDrafter(self.cfg.drafter_training, drafter, self.policy_target, self.out_dir,
                                         self.cfg.run.seed)
            if trained:
                self.drafter.load_state_dict(load_state(ckpt / f"{STATE_FILE}.pt", required=STATE_KEYS))
                drafter = self.drafter.export()
            elif ckpt is not None:
                print(f"warning: {ckpt.name} holds no trained head ({STATE_FILE}.pt): drafter_training starts "
                      f"again from {drafter}", flush=True)
        elif trained:
            print(f"note: {ckpt.name} holds the head trained so far ({ckpt / 'drafter'}); with "
                  f"drafter_training.every 0 the actors draft with model.drafter ({drafter}) instead", flush=True)
        spec = WorkerSpec(target=self.cfg.model.target, drafter_path=str(drafter) if drafter else None,
                          sampling=sampling, spec=r.spec, verifier=r.behaviour_verifier, threads=r.threads_per_actor,
                          device="cuda" if r.num_gpus_per_actor > 0 else "cpu", backend=r.backend,
                          backend_options=dict(r.backend_options))
        self.pool = RolloutPool(spec, r.num_actors, num_cpus_per_actor=r.threads_per_actor,
                                num_gpus_per_actor=r.num_gpus_per_actor, max_restarts=r.max_restarts,
                                timeout_s=r.actor_timeout_s)
        self.pool.set_weights(self.policy.state_dict(), self.version)

    def prompt_ids(self, problem: Problem) -> list[int]:
        return chat_ids(self.tokenizer, problem.prompt, system=self.cfg.task.system_prompt)

    # ------------------------------------------------------------------ one step
    def rollout(self, step: int):
        problems = self.problems.for_step(step)
        g = self.cfg.grpo.group_size
        ids, prompts, answers = [], [], []
        for i, prob in enumerate(problems):
            p = self.prompt_ids(prob)
            for j in range(g):
                ids.append(f"{step}/{i}/{j}")
                prompts.append(p)
                answers.append(prob.answer)
        batch, _ = self.pool.generate(ids, prompts, seed=self.cfg.run.seed * 7919 + step)
        return problems, answers, batch

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        problems, answers, batch = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        texts = self.tokenizer.batch_decode(batch.completion_lists(), skip_special_tokens=True)
        rewards = torch.tensor([answer_reward(t, a, self.cfg.reward) for t, a in zip(texts, answers)])
        correct = torch.tensor([exact_match_reward(t, a) >= 1.0 for t, a in zip(texts, answers)])
        g = self.cfg.grpo.group_size
        adv = group_advantages(rewards.view(-1, g), scale_std=self.cfg.grpo.scale_std,
                               eps=self.cfg.grpo.std_eps).reshape(-1)
        metrics, records = self.update(batch, adv)
        if self.drafter is not None and self.drafter.due(step):
            metrics.update(self.drafter.train_on_batch(step, batch))
            self.pool.load_drafter(str(self.drafter.export_path))
        metrics.update(reward_stats(rewards.view(-1, g), correct.view(-1, g)))
        tokens = batch.timings["tokens"]
        metrics.update(tau=batch.tau, rollout_tokens=tokens, rollout_s=t_rollout,
                       rollout_tokens_per_s=tokens / max(t_rollout, 1e-9),
                       completion_len_mean=tokens / max(len(batch), 1),
                       policy_version=float(self.version), actor_restarts=float(self.pool.stats.restarts),
                       step_s=time.perf_counter() - t0)
        for rec, r, text in zip(records, rewards.tolist(), texts):
            rec.update(reward=r, text=text)
        self.logger.log_rollouts(step + 1, records)
        return metrics

    def update(self, batch: RolloutBatch, adv: torch.Tensor) -> tuple[dict[str, float], list[dict]]:
        """Corrected GRPO loss over the batch, one optimizer step, weight broadcast.

        With one gradient step per batch, pi_old is the policy as it is now: its log-probs
        come from the same forward as the gradient (detached), with no extra pass. The
        importance weights of a micro-batch need only its own sequences, so the
        per-sequence modes are exact; the logged weight statistics cover the whole batch.
        """
        c = self.cfg
        prompts, outs = batch.prompt_lists(), batch.completion_lists()
        mb = c.optim.micro_batch
        behaviour, target_lp, relaxed, mask = (t.to(self.device) for t in (
            batch.behaviour_logprobs, batch.target_logprobs, batch.relaxed, batch.completion_mask))
        adv = adv.to(self.device)
        total_tokens = mask.sum().clamp(min=1).item()
        # sequence aggregation averages over the sequences with a token, so a micro-batch's share
        # is its such sequences over the batch's (an empty completion counts in neither)
        scored = mask.any(dim=1)
        total_scored = scored.sum().clamp(min=1).item()
        logp_old = torch.zeros_like(behaviour)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, clip_frac = 0.0, 0.0
        # the micro-batches that cost least, a group's rows sharing their prompt's forward (the
        # gradient is a sum over micro-batches, so their order and make-up do not change it)
        paths = forward_paths(self.policy, c.optim.share_prompts)
        for rows in micro_batches(prompts, outs, mb, cost=ForwardCost.of(self.policy.config), paths=paths):
            idx = torch.tensor(rows, device=mask.device)
            mb_prompts, mb_outs = [prompts[i] for i in rows], [outs[i] for i in rows]
            logp_new = self._logprobs(self.policy, mb_prompts, mb_outs, mask.shape[1])
            logp_old[idx] = logp_new.detach()
            weights, _, _ = importance_weights(logp_old[idx], behaviour[idx], mask[idx], c.correction)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.reference, mb_prompts, mb_outs, mask.shape[1])
            loss, pg_stats = policy_loss(logp_new, logp_old[idx], adv[idx], mask[idx], is_weights=weights,
                                         ref_logp=ref, **c.grpo.loss_kwargs())
            share = (mask[idx].sum().item() / total_tokens if c.grpo.aggregation == "token"
                     else scored[idx].sum().item() / total_scored)
            (loss * share).backward()
            loss_sum += loss.item() * share
            clip_frac += pg_stats["clip_frac"] * share
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(),
                                                   c.optim.grad_clip if c.optim.grad_clip > 0 else float("inf"))
        check_loss_and_grad(self.version + 1, loss_sum, grad_norm)
        self.optimizer.step()
        check_weights(self.version + 1, self.policy)
        self.version += 1
        self.pool.set_weights(self.policy.state_dict(), self.version)
        weights, _, is_stats = importance_weights(logp_old, behaviour, mask, c.correction)
        inside = mask.bool() & torch.isfinite(logp_old)  # (outside the trainer's top-p/top-k: is_outside_support_frac)
        stale = (logp_old - target_lp).abs()[inside].max().item() if inside.any() else 0.0
        metrics = dict(is_stats, loss=loss_sum, grad_norm=float(grad_norm), clip_frac=clip_frac,
                       relaxed_frac=relaxed_fraction(relaxed, mask), rollout_vs_trainer_logp_max=stale)
        return metrics, _records(outs, behaviour, target_lp, logp_old, relaxed, weights)

    def _logprobs(self, model, prompts, outs, width: int) -> torch.Tensor:
        s = self.cfg.rollout.sampling
        logp, _ = completion_logprobs(model, prompts, outs, temperature=s.temperature, top_k=s.top_k,
                                      top_p=s.top_p, pad_id=self.pad_id, share_prompts=self.cfg.optim.share_prompts)
        return torch.nn.functional.pad(logp, (0, width - logp.shape[1]))

    # ------------------------------------------------------------------ the run
    def run(self, after_step: StepHook | None = None) -> list[dict]:
        """Train from the start step to ``run.steps``; returns the metrics rows (``finish``).

        ``after_step(trainer, step)``, when given, is called once the run has started (``step`` =
        the step it starts from: 0, or the resumed checkpoint's) and after each step's metrics are
        logged, before that step's checkpoint: a step whose checkpoint exists has had its call.
        It sees the policy in memory (e.g. the study's held-out evaluation, ``trainers.study``);
        what it raises stops the run there."""
        self.start()
        steps = self.cfg.run.steps
        try:
            if after_step is not None:
                after_step(self, self.start_step)
            for step in range(self.start_step, steps):
                m = self.step(step)
                self.logger.log(step + 1, m)
                parts = [f"{label}{m[k]:{fmt}}{unit}" for k, label, fmt, unit in (
                    ("drafter_est_tau", "tau ", ".2f", ""), ("drafter_loss", "loss ", ".3f", ""),
                    ("drafter_s", "", ".1f", "s")) if k in m]  # a round without positions has no tau or loss
                head = "  head " + " ".join(parts) if parts else ""
                print(f"step {step + 1}/{steps}  reward {m['reward_mean']:.3f}  acc {m['accuracy']:.2f}  "
                      f"tau {m['tau']:.2f}  tok/s {m['rollout_tokens_per_s']:.1f}  relaxed {m['relaxed_frac']:.2f}  "
                      f"KL k1 {m['kl_k1']:.2e} k3 {m['kl_k3']:.2e}  ESS {m['is_ess']:.3f}  {m['step_s']:.1f}s{head}", flush=True)
                if after_step is not None:
                    after_step(self, step + 1)
                every = self.cfg.run.checkpoint_every
                if (every and (step + 1) % every == 0) or step + 1 == steps:
                    self.save(step + 1)
        finally:
            self.logger.close()
            if self.pool is not None:
                self.pool.shutdown()
        return self.finish()

    def save(self, step: int) -> None:
        state, keep = {"version": self.version, "seed": self.cfg.run.seed}, self.cfg.run.keep_checkpoints
        if self.drafter is None:
            save_checkpoint(self.out_dir, step, self.policy, self.optimizer, state, self.cfg.model.drafter_path(),
                            keep=keep)
            return
        save_checkpoint(self.out_dir, step, self.policy, self.optimizer, state, self.drafter.export(),
                        extra={STATE_FILE: self.drafter.state_dict()}, keep=keep)

    def finish(self) -> list[dict]:
        rows, table, plots = write_report(self.out_dir)
        print("\n" + table, flush=True)
        print(f"\noutputs in {self.out_dir.resolve()}: metrics.jsonl, rollouts.jsonl, tb/, checkpoints/, "
              f"summary.md, plots/ ({', '.join(p.name for p in plots)})", flush=True)
        return rows


def _records(outs, behaviour, target_lp, logp_old, relaxed, weights) -> list[dict]:
    """Per completion, what rollouts.jsonl keeps for drift diagnostics after the fact."""
    def row(t: torch.Tensor, i: int) -> list[float]:
        return [round(v, 6) for v in t[i, : len(outs[i])].tolist()]

    return [dict(completion_ids=list(outs[i]), behaviour_logprobs=row(behaviour, i), target_logprobs=row(target_lp, i),
                 policy_logprobs=row(logp_old, i), relaxed=relaxed[i, : len(outs[i])].int().tolist(),
                 weights=row(weights, i)) for i in range(len(outs))]
