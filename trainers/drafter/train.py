"""EAGLE-3 drafter training: the config, initialisation from the target, the training loop
with checkpoints, held-out evaluation and the draft-temperature calibration. The
training-time-test math (masks, unrolled forward, loss, acceptance) is ``trainers/drafter/ttt.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollout.config import ConfigError, check_int, check_number
from rollout.eagle3 import Eagle3Head
from rollout.models import TargetConfig, TargetModel
from trainers.drafter.data import DrafterDataConfig
from trainers.drafter.ttt import OBJECTIVES, estimated_block_tau, estimated_tau, summed_acceptance, ttt_loss


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter training.

    target / data: see :class:`TargetConfig`, :class:`DrafterDataConfig`.
    draft_vocab_size: Vd; init: how to start ("random", "lm_head", "layer": from the target,
    see :func:`init_from_target`; "head": from the trained head at ``init_head``, a folder or
    "default" for the shipped head, whose draft vocabulary and logit scale it keeps, to adapt
    a head to new data such as a policy that training has moved);
    objective: the loss, "ce" (soft cross-entropy), "tv" (one minus the expected T = 1
    acceptance at the head's logit scale, plus ``ce_weight`` x "ce") or "block" (one minus the
    joint overlap of each prefix of the chain, which bounds what any lossless verifier accepts; needs
    ``data.greedy_fraction: 0``); see ``trainers/drafter/ttt.py``;
    ttt_steps / step_weight: unrolled steps and their 0.8^s weights; epochs, batch_size,
    max_steps (cap, None = epochs only); lr (peak), min_lr_ratio (cosine floor),
    warmup_steps, weight_decay, betas, grad_clip: AdamW; seed: the random initial weights
    (scripts.train_drafter) and the batch order;
    out_dir: checkpoints and logs; save_every / eval_every: in optimizer steps;
    device: "auto" (cuda when available), "cpu" or "cuda"; export_dtype: dtype of the
    exported head; threads: torch CPU threads (None = torch default).
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DrafterDataConfig = field(default_factory=DrafterDataConfig)
    draft_vocab_size: int = 8192
    init: str = "random"
    init_head: str | None = None
    objective: str = "ce"
    ce_weight: float = 0.0
    ttt_steps: int = 7
    step_weight: float = 0.8
    epochs: int = 2
    batch_size: int = 16
    max_steps: int | None = None
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    seed: int = 0
    out_dir: str = "runs/drafter"
    save_every: int = 100
    eval_every: int = 200
    device: str = "auto"
    export_dtype: str = "bfloat16"
    threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        for name in ("draft_vocab_size", "ttt_steps", "epochs", "batch_size", "save_every", "eval_every"):
            check_int(name, getattr(self, name))
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps)
        check_number("step_weight", self.step_weight, 0, 1, low_open=True)
        check_number("lr", self.lr, 0, low_open=True, finite=True)
        check_number("min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", "must be two numbers in [0, 1)")
        if self.grad_clip <= 0:
            raise ConfigError("grad_clip", "must be positive")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", f"unknown device {self.device!r}", allowed=("auto", "cpu", "cuda"))
        if self.init not in INIT_MODES + ("head",):
            raise ConfigError("init", f"unknown mode {self.init!r}", allowed=INIT_MODES + ("head",))
        if (self.init == "head") != (self.init_head is not None):
            raise ConfigError("init_head", "set it (a head folder or 'default') exactly when init is 'head'; "
                              f"got init {self.init!r}, init_head {self.init_head!r}")
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", f"unknown objective {self.objective!r}", allowed=OBJECTIVES)
        check_number("ce_weight", self.ce_weight, 0, None, finite=True)
        if self.ce_weight and self.objective != "tv":
            raise ConfigError("ce_weight", "adds the cross-entropy to the 'tv' objective only; "
                              f"the objective is {self.objective!r}")
        if self.objective == "block" and self.data.greedy_fraction > 0:
            raise ConfigError("data.greedy_fraction", "objective 'block' estimates its loss along responses "
                              "sampled from the target at T = 1; greedy answers would bias it: set it to 0, "
                              f"got {self.data.greedy_fraction}")
        if self.export_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("export_dtype", "unknown dtype", allowed=("float32", "bfloat16", "float16"))


# ----------------------------------------------------------------------------- init


INIT_MODES = ("random", "lm_head", "layer")


@torch.no_grad()
def init_from_target(head: Eagle3Head, target: TargetModel, mode: str) -> None:
    """Initialise ``head`` from the target.

    "random": nothing. "lm_head": norm and lm_head from the target's final norm and the rows
    of its output embedding (lm_head, tied or not) for the draft vocabulary. "layer": that, plus "one more target layer":
    fc picks the last feature (the input of layer ``L = aux_layer_ids[2]``) and the draft
    layer copies layer L acting on it (the embedding half of q/k/v starts at zero), so the
    step-0 output hidden is exactly the input of layer L + 1. Note that this hidden belongs
    to token i, whose successor i + 1 the draft already gets as input: the starting point
    predicts the known token, not the next one.
    """
    if mode not in INIT_MODES:
        raise ConfigError("init", f"unknown mode {mode!r}", allowed=INIT_MODES)
    if mode == "random":
        return
    head.norm.weight.copy_(target.model.model.norm.weight)
    head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[head.target_ids])
    if mode == "layer":
        _copy_layer(head, target)


def _copy_layer(head: Eagle3Head, target: TargetModel) -> None:
    c, h = head.cfg, target.hidden_size
    if (c.hidden_size, c.target_hidden_size) != (h, h):
        raise ValueError("init 'layer' needs a head as wide as the target")
    layer = target.decoder_layers[target.aux_layer_ids[2]]
    attn = layer.self_attn
    if any(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or hasattr(attn, "q_norm"):
        raise ValueError(f"init 'layer' copies a Llama-style layer; the target's {type(layer).__name__} has "
                         "attention biases or q/k norms: use init 'lm_head' or 'random'")
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * h:] = torch.eye(h)
    mid = head.midlayer
    mid.input_layernorm.weight.fill_(1.0)
    mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(mid.self_attn, name).weight
        src = getattr(layer.self_attn, name).weight
        if w.shape != (src.shape[0], 2 * h):
            raise ValueError(f"init 'layer': {name} shape {tuple(w.shape)} does not fit the target layer")
        w.zero_()
        w[:, h:] = src
    mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)


def lr_at(cfg: DrafterConfig, step: int, total: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------- loop


def epoch_batches(lengths: list[int], batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffle, group similar lengths (chunks of 8 batches sorted by length), shuffle the batches."""
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    batches = []
    chunk = batch_size * 8
    for start in range(0, len(perm), chunk):
        group = sorted(perm[start: start + chunk], key=lambda i: lengths[i])
        batches += [group[j: j + batch_size] for j in range(0, len(group), batch_size)]
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order]


@torch.no_grad()
def _acceptance_sums(head: Eagle3Head, data, cfg: DrafterConfig, device: torch.device,
                     scales: tuple[float, ...], block: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """``ttt_acceptance`` summed over the held-out batches of each prompt kind."""
    return {kind: summed_acceptance(head, data, [i for i, k in enumerate(data.kinds) if k == kind], cfg.ttt_steps,
                                    scales, cfg.batch_size, device, block=block)
            for kind in sorted(set(data.kinds))}


def _kind_report(sums: dict[str, torch.Tensor], i: int) -> dict[str, object]:
    """Acceptance rates per step and the chain tau they imply, T = 1 figures at scale index i."""
    n = sums["count"].clamp(min=1)
    a0, a1 = (sums["acc_t0"] / n).tolist(), (sums["acc_t1"][i] / n).tolist()
    report = {"acc_t0": [round(a, 4) for a in a0], "acc_t1": [round(a, 4) for a in a1],
              "est_tau_t0": round(estimated_tau(a0), 3), "est_tau_t1": round(estimated_tau(a1), 3)}
    if "acc_block" in sums:
        ab = (sums["acc_block"][i] / sums["count_block"].clamp(min=1)).tolist()
        report |= {"acc_block": [round(a, 4) for a in ab], "est_tau_block": round(estimated_block_tau(ab), 3)}
    return report


def evaluate(head: Eagle3Head, data, cfg: DrafterConfig, device: torch.device,
             scale: float = 1.0) -> dict[str, object]:
    """Teacher-forced held-out acceptance per step and the chain tau it implies, per prompt kind
    (``scale``: the draft logit scale for the T = 1 figures); with the "block" objective also the
    joint overlaps and the ceiling they put on tau (``acc_block``, ``est_tau_block``)."""
    sums = _acceptance_sums(head, data, cfg, device, (scale,), block=cfg.objective == "block")
    return {kind: _kind_report(kind_sums, 0) for kind, kind_sums in sums.items()}


LOGIT_SCALES = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0)


def calibrate_logit_scale(head: Eagle3Head, data, cfg: DrafterConfig, device: torch.device,
                          grid: tuple[float, ...] = LOGIT_SCALES) -> tuple[float, dict[float, float]]:
    """The draft temperature that maximises held-out chain acceptance at T = 1: the scale s of
    the grid with the largest teacher-forced ``est_tau_t1`` (mean over prompt kinds) when the
    draft samples from softmax(s * logits). A head trained with soft cross-entropy on little
    data is under-confident, so s > 1 usually wins. Returns (best scale, {scale: mean est tau}).
    One pass over the held-out data scores the whole grid."""
    sums = _acceptance_sums(head, data, cfg, device, tuple(grid))
    taus = {scale: sum(_kind_report(k, i)["est_tau_t1"] for k in sums.values()) / len(sums)
            for i, scale in enumerate(grid)}
    return max(taus, key=taus.get), taus


def train_drafter(
    cfg: DrafterConfig, head: Eagle3Head, data, heldout=None, *, resume: bool = True, log=print,
    progress: bool = True, stop_at: int | None = None,
) -> dict[str, object]:
    """Train ``head`` (draft vocabulary already set) on ``data``; checkpoint to ``cfg.out_dir``.

    With ``resume`` and a checkpoint in ``out_dir``, continues from it exactly (the batch
    order is a function of (seed, epoch)). ``stop_at`` ends the run early at that step
    (after checkpointing) without changing the schedule. Returns the last losses and
    held-out report.
    """
    from pathlib import Path

    from tqdm import tqdm

    from trainers.drafter.data import collate

    device = next(head.parameters()).device
    out_dir = Path(cfg.out_dir)
    ckpt_path = out_dir / "checkpoint.pt"
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    lengths = [int(data.offsets[i + 1] - data.offsets[i]) for i in range(len(data))]
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = min(cfg.epochs * per_epoch, cfg.max_steps or 10**12)
    step = 0
    if resume and ckpt_path.is_file():
        from trainers.grpo.checkpoint import load_state

        state = load_state(ckpt_path, required=("head", "opt", "step"), map_location=device,
                           advice="delete it (or pass --no-resume) to train from the start")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
        log(f"resumed from {ckpt_path} at step {step}/{total}")
    head.train()
    report: dict[str, object] = {"steps": total}
    bar = tqdm(total=total, initial=step, desc="train drafter", unit="step", disable=not progress)
    batches, batches_epoch = [], -1
    while step < min(total, stop_at or total):
        epoch = step // per_epoch
        if epoch != batches_epoch:
            batches = epoch_batches(lengths, cfg.batch_size, torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
            batches_epoch = epoch
        batch = collate(data, batches[step % per_epoch], device)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, total)
        loss, per_step = ttt_loss(head, batch, cfg.ttt_steps, cfg.step_weight, cfg.objective,
                                  ce_weight=cfg.ce_weight, scale=head.cfg.logit_scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", s0=f"{per_step[0]:.2f}", s6=f"{per_step[-1]:.2f}")
        report.update(loss=float(loss.detach()), step_losses=per_step)
        if step % cfg.save_every == 0 or step in (total, stop_at):
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            tmp.replace(ckpt_path)
        if heldout is not None and (step % cfg.eval_every == 0 or step == total):
            report["heldout"] = evaluate(head, heldout, cfg, device, scale=head.cfg.logit_scale)
            log(f"step {step}: loss {float(loss.detach()):.4f} heldout {report['heldout']}")
    bar.close()
    return report
