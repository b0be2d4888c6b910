"""Training the EAGLE-3 head during GRPO training, on the policy's own rollouts.

A fixed head keeps every rollout exact (the verifier corrects any draft), but the policy moves
away from the model the head was trained on, and the acceptance tau falls with it. With
``drafter_training.every: n`` the trainer keeps a copy of the head and, after every n-th policy
step:

1. **features**: runs the *updated* policy (the one the next rollouts come from) once, without
   gradients, over this step's sequences (prompt + completion), capturing the EAGLE-3 features
   (the aux layers' inputs) and the final norm's output at every position: the same records
   ``trainers.drafter.data`` builds from plain decoding (each group's prompt run once, on the
   engine's CPU kernels). The completions are samples of the previous policy under the rollout
   verifier; what the head learns is the new policy's next-token distribution at every position
   of them (the loss never uses the sampled token);
2. **score**: the head's teacher-forced acceptance on these samples before it has seen them
   (``drafter_est_tau``: ``1 + sum_k prod_{s<k} a_s`` over the per-step T = 1 acceptance
   ``a_s`` at the head's logit scale, ``trainers.drafter.ttt``): how well the head fits the
   policy it is about to draft for, on held-out data; with ``score_initial``, also the head as
   it was loaded (``drafter_est_tau_initial``), on the same samples: what training gained;
3. **train**: appends the records to a window of the last ``buffer`` samples and runs
   ``updates`` AdamW steps of the TTT loss (``objective``: "tv" or "ce") on batches drawn from
   it (seeded by (run seed, step), so a resumed run draws the same batches);
4. **ship**: writes the head, rounded to ``export_dtype``, to ``<out_dir>/drafter/`` (written
   beside and renamed in) and every rollout actor re-loads it (``RolloutPool.load_drafter``:
   the hf and vLLM backends, replacement actors included; the files go through Ray's object
   store, so actors on other nodes need no shared storage).

The head's fp32 weights, its optimizer and the window are saved with each checkpoint
(``drafter_training.pt``), so a resumed run continues the same head.

Cost: the feature forward is one forward of the policy over the batch (no backward; on the CPU
kernels, whose packed copy of the policy is dropped after it), each
score one unrolled forward of the head, and each update a TTT forward and backward of the
one-layer head; ``drafter_features_s`` and ``drafter_s`` log them (on ``make run``'s 32 rows on
2 cores, 1.7-2.6 s and 6.8-9.1 s a round). A non-finite head loss stops the run
(:class:`trainers.grpo.guards.NonFiniteError`) before that head ships or is saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.config import ConfigError, check_int, check_number, is_number
from rollout.eagle3 import Eagle3Head, load_eagle3, save_eagle3
from rollout.kernels import native_linear
from rollout.models import TargetModel
from rollout.outputs import RolloutBatch
from trainers.drafter.data import DrafterData, collate, make_record, records_to_data
from trainers.drafter.ttt import estimated_tau, summed_acceptance, ttt_loss
from trainers.grpo.checkpoint import load_optimizer_state
from trainers.grpo.guards import NonFiniteError
from trainers.grpo.policy import cache_kwarg


OBJECTIVES = ("tv", "ce")  # "block" needs responses sampled at T = 1 from the target itself
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STATE_FILE = "drafter_training"  # the checkpoint's ``drafter_training.pt``
STATE_KEYS = ("head", "optimizer", "rounds", "window")  # what OnlineDrafter.state_dict holds


@dataclass(frozen=True)
class OnlineDrafterConfig:
    """every: train the head after every n-th policy step (0: never, the head stays as loaded);
    updates: head optimizer steps per round; batch_size: samples per head step; buffer: the
    most recent samples kept to train on; lr, betas, weight_decay, grad_clip: AdamW;
    objective: "tv" (one minus the expected T = 1 acceptance, plus ``ce_weight`` x the soft
    cross-entropy; ``ce_weight`` null: 0.1 with "tv", 0 with "ce") or "ce" (``trainers.drafter.ttt``); ttt_steps, step_weight: the unrolled
    draft steps and their weights; feature_batch: sequences per feature forward;
    export_dtype: the dtype the actors' head is written in ("bfloat16": half the bytes per draft
    step on this project's kernels; "float32"); score_initial: also score the head as it was
    loaded on each round's fresh samples (``drafter_est_tau_initial``: what training it gained,
    measured on the same held-out samples; one more no-grad pass of the head)."""

    every: int = 0
    updates: int = 4
    batch_size: int = 8
    buffer: int = 64
    lr: float = 3e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    objective: str = "tv"
    ce_weight: float | None = None  # None: 0.1 with objective "tv", 0 with "ce"
    ttt_steps: int = 4
    step_weight: float = 0.8
    feature_batch: int = 8
    export_dtype: str = "bfloat16"
    score_initial: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas) if isinstance(self.betas, (list, tuple)) else self.betas)
        check_int("every", self.every, 0)
        for name in ("updates", "batch_size", "buffer", "ttt_steps", "feature_batch"):
            check_int(name, getattr(self, name))
        check_number("lr", self.lr, 0, low_open=True, finite=True)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2 or not all(
                is_number(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        check_number("weight_decay", self.weight_decay, 0, finite=True)
        check_number("grad_clip", self.grad_clip, 0, low_open=True, finite=True)
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", f"unknown objective {self.objective!r} (\"block\" needs responses "
                              "the target sampled at T = 1, which rollouts are not)", allowed=OBJECTIVES)
        if self.ce_weight is None:
            object.__setattr__(self, "ce_weight", 0.1 if self.objective == "tv" else 0.0)
        check_number("ce_weight", self.ce_weight, 0, finite=True)
        if self.ce_weight and self.objective != "tv":
            raise ConfigError("ce_weight", "adds the cross-entropy to the 'tv' objective only; set it to 0 "
                              f"with objective {self.objective!r}")
        check_number("step_weight", self.step_weight, 0, 1, low_open=True)
        if not isinstance(self.score_initial, bool):
            raise ConfigError("score_initial", f"must be true or false, got {self.score_initial!r}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError("export_dtype", f"unknown dtype {self.export_dtype!r}", allowed=tuple(EXPORT_DTYPES))

    @property
    def enabled(self) -> bool:
        return self.every > 0


@torch.no_grad()
def rollout_records(target: TargetModel, sequences: list[list[int]], prompt_lens: list[int],
                    batch: int) -> DrafterData:
    """The drafter-data records (``trainers.drafter.data``) of ``sequences`` (prompt +
    completion token ids) under ``target`` as it is now, without gradients. Rows that share a
    prompt (a GRPO group) run it once: one forward of the prompt, its KV cache repeated for up
    to ``batch`` of them, one forward of their completions (right-padded). ``argmax`` and ``lse``
    are filled only where the target predicts a completion token (the positions the loss and the
    acceptance read; -1 and 0 before), which skips the prompt's share of the wide output layer."""
    assert len(sequences) == len(prompt_lens) and sequences, "need one prompt length per sequence"
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
        if not 0 < plen <= len(seq):
            raise ValueError(f"sequence {i}: prompt length {plen} does not fit its {len(seq)} tokens")
        groups.setdefault(tuple(seq[:plen]), []).append(i)
    records: dict[int, dict[str, torch.Tensor]] = {}
    with native_linear.routed(target.model):  # the engine's CPU kernels (the torch path elsewhere)
        for prompt, rows in groups.items():
            for start in range(0, len(rows), batch):
                part = rows[start: start + batch]
                completions = [sequences[i][len(prompt):] for i in part]
                records.update(zip(part, _group_records(target, list(prompt), completions)))
    native_linear.release(target.model)  # not a second copy of the policy between rounds
    return records_to_data([records[i] for i in range(len(sequences))], list(prompt_lens),
                           ["rollout"] * len(sequences))


def _group_records(target: TargetModel, prompt: list[int], completions: list[list[int]]) -> list[dict]:
    """The records of ``prompt`` followed by each of ``completions`` (see :func:`rollout_records`):
    the prompt once and its KV cache under the completions, or, for a model whose forward takes no
    cache (``trainers.grpo.policy.cache_kwarg``), every row whole."""
    from transformers import DynamicCache

    device, p, g = target.device, len(prompt), len(completions)
    width = max(len(c) for c in completions)
    ids = torch.zeros(g, width, dtype=torch.long)
    mask = torch.ones(g, p + width, dtype=torch.long)
    for r, c in enumerate(completions):
        ids[r, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[r, p + len(c):] = 0
    body, kwarg = target.model.model, cache_kwarg(target.model.model)
    if kwarg is None:
        with target.capture(final=True) as cap:
            body(input_ids=torch.cat([torch.tensor([prompt]).expand(g, -1), ids], 1).to(device),
                 attention_mask=mask.to(device), use_cache=False)
        features, final = cap.features(), cap.final()  # [g, P + W, 3H], [g, P + W, H]
        pf, pfinal, cf, cfinal = features[0, :p], final[0, :p], features[:, p:], final[:, p:]
    else:
        cache = DynamicCache()
        with target.capture(final=True) as cap:
            body(input_ids=torch.tensor([prompt], device=device), use_cache=True, **{kwarg: cache})
        pf, pfinal = cap.features()[0], cap.final()[0]  # [P, 3H], [P, H]
        if width:
            cache.batch_repeat_interleave(g)
            with target.capture(final=True) as cap:
                body(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True,
                     position_ids=torch.arange(p, p + width, device=device).expand(g, -1), **{kwarg: cache})
            cf, cfinal = cap.features(), cap.final()  # [g, W, 3H], [g, W, H]
    out = []
    for r, c in enumerate(completions):
        n = p + len(c)
        features = torch.cat([pf, cf[r, : len(c)]]) if c else pf  # [n, 3H]
        final = torch.cat([pfinal, cfinal[r, : len(c)]]) if c else pfinal
        logits = target.logits(final[p - 1: n - 1])  # predicts the completion's tokens
        out.append(make_record(prompt + list(c), features[: n - 1], final[: n - 1], logits))
    return out


def teacher_forced_tau(head: Eagle3Head, data: DrafterData, steps: int, batch: int) -> tuple[float, float] | None:
    """The chain tau the head's teacher-forced acceptance on ``data`` implies, at T = 1 (its
    logit scale) and at T = 0 (``trainers.drafter.ttt.estimated_tau``); None when ``data`` has
    no position to score (every completion empty)."""
    sums = summed_acceptance(head, data, list(range(len(data))), steps, (head.cfg.logit_scale,), batch,
                             next(head.parameters()).device)
    if not (sums["count"] > 0).any():
        return None
    n = sums["count"].clamp(min=1)
    return estimated_tau(sums["acc_t1"][0] / n), estimated_tau(sums["acc_t0"] / n)


class OnlineDrafter:
    """The trainer's copy of the head, trained on the rollouts (see the module doc)."""

    def __init__(self, cfg: OnlineDrafterConfig, head_path: Path, target: TargetModel, out_dir: Path, seed: int):
        self.cfg, self.target, self.seed = cfg, target, seed
        self.head_path = Path(head_path)  # the configured head: shipped as it is until the first round
        self.export_path = Path(out_dir) / "drafter"
        self.head = load_eagle3(head_path, target).to(target.device)
        target.attach_to(self.head)
        self.head.train()
        self.initial = load_eagle3(head_path, target).to(target.device) if cfg.score_initial else None
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.window: list[DrafterData] = []  # the last ``buffer`` samples, one DrafterData each
        self.rounds = 0
        self._exported = False  # whether export_path holds the head as it is now

    def due(self, step: int) -> bool:
        """Whether the round after policy step ``step`` (0-based) trains the head."""
        return self.cfg.enabled and (step + 1) % self.cfg.every == 0

    def train_on_batch(self, step: int, batch: RolloutBatch) -> dict[str, float]:
        """:meth:`train_round` on a generation's sequences (each row's prompt + completion)."""
        prompts = batch.prompt_lists()
        sequences = [p + c for p, c in zip(prompts, batch.completion_lists())]
        return self.train_round(step, sequences, [len(p) for p in prompts])

    def train_round(self, step: int, sequences: list[list[int]], prompt_lens: list[int]) -> dict[str, float]:
        """Features of the current policy over ``sequences`` (the policy in eval mode: no dropout
        in them; its mode is restored after), the head's score on them, then ``updates`` head
        steps on the window; returns the round's metrics. The head is exported after."""
        c = self.cfg
        t0 = time.perf_counter()
        model = self.target.model
        training = model.training
        model.eval()
        try:
            fresh = rollout_records(self.target, sequences, prompt_lens, c.feature_batch)
        finally:
            model.train(training)
        t_features = time.perf_counter() - t0
        scores: dict[str, float] = {}  # none when every completion is empty: nothing to score
        taus = teacher_forced_tau(self.head, fresh, c.ttt_steps, c.batch_size)
        if taus is not None:
            scores = {"drafter_est_tau": taus[0], "drafter_est_tau_t0": taus[1]}
            if self.initial is not None:
                scores["drafter_est_tau_initial"] = teacher_forced_tau(self.initial, fresh, c.ttt_steps,
                                                                       c.batch_size)[0]
        self.window = (self.window + [_sample(fresh, i) for i in range(len(fresh))])[-c.buffer:]
        data = DrafterData.concat(self.window)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        device = next(self.head.parameters()).device
        losses = []
        for _ in range(c.updates):
            idx = torch.randperm(len(data), generator=gen)[: c.batch_size].tolist()
            batch = collate(data, idx, device)
            if not batch.lossable.any():  # no position to learn from: no step (AdamW's momentum would still move)
                continue
            loss, _ = ttt_loss(self.head, batch, c.ttt_steps, c.step_weight, c.objective,
                               ce_weight=c.ce_weight, scale=self.head.cfg.logit_scale)
            if not torch.isfinite(loss):  # stops the run (exit 3) before a broken head ships or is saved
                raise NonFiniteError(step + 1, "drafter loss", f"update {len(losses) + 1} of the head's round: "
                                     f"{float(loss.detach())}; lower drafter_training.lr")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.grad_clip)
            self.optimizer.step()
            self._exported = False
            losses.append(float(loss.detach()))
        self.rounds += 1
        self.export()
        loss = {"drafter_loss": sum(losses) / len(losses)} if losses else {}
        return scores | loss | {"drafter_updates": float(len(losses)), "drafter_features_s": t_features,
                                "drafter_s": time.perf_counter() - t0}

    def export(self) -> Path:
        """Write the head in ``export_dtype`` to ``export_path`` (into a sibling folder, then
        renamed over the old one, so a reader never sees half a head), unless that folder already
        holds the head as it is (written since the last update or state load). Before the first
        round the head is the configured one: its folder is copied as it is (a head stored in
        fp32 or fp16 is not rounded, so a checkpoint taken then resumes with the head the actors had)."""
        import shutil

        if self._exported and self.export_path.is_dir():
            return self.export_path
        if self.rounds == 0 and self.export_path.resolve() == self.head_path.resolve():
            self._exported = True
            return self.export_path
        tmp = self.export_path.with_name(self.export_path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.rounds == 0:
            shutil.copytree(self.head_path, tmp)
        else:
            save_eagle3(_rounded(self.head, EXPORT_DTYPES[self.cfg.export_dtype]), tmp)
        old = self.export_path.with_name(self.export_path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.export_path.exists():
            self.export_path.rename(old)
        tmp.rename(self.export_path)
        shutil.rmtree(old, ignore_errors=True)
        self._exported = True
        return self.export_path

    def state_dict(self) -> dict:
        """Tensors and plain containers only (the window's samples as dicts, not DrafterData), so
        the checkpoint's file loads with ``torch.load(weights_only=True)``."""
        return {"head": {k: v.detach().cpu().clone() for k, v in self.head.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "rounds": self.rounds,
                "window": [w.__dict__ for w in self.window]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s head, window and optimizer state; the optimizer keeps the
        config's lr, betas and weight_decay (a changed one is logged)."""
        self.head.load_state_dict(state["head"])
        load_optimizer_state(self.optimizer, state["optimizer"], "drafter_training")
        self.rounds = int(state["rounds"])
        self.window = [DrafterData(**w) for w in state["window"]]
        self._exported = False


def _sample(data: DrafterData, i: int) -> DrafterData:
    """Sample ``i`` of ``data`` on its own (copies: a view would keep, and a checkpoint save, the
    whole round's tensors behind it)."""
    lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
    return DrafterData(tokens=data.tokens[lo:hi].clone(), features=data.features[lo:hi].clone(),
                       final=data.final[lo:hi].clone(), argmax=data.argmax[lo:hi].clone(),
                       lse=data.lse[lo:hi].clone(), offsets=torch.tensor([0, hi - lo]),
                       prompt_lens=data.prompt_lens[i: i + 1].clone(), kinds=[data.kinds[i]])


def _rounded(head: Eagle3Head, dtype: torch.dtype) -> Eagle3Head:
    """A copy of ``head``'s weights in ``dtype`` (sharing its embedding, which is not saved)."""
    out = Eagle3Head(head.cfg, head.embed_tokens)
    out.load_state_dict(head.state_dict())
    return out.to(dtype).requires_grad_(False)
