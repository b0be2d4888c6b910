"""``SpeculativeGRPOTrainer``: TRL's GRPOTrainer with our rollouts and TRL's own off-policy
correction switched on.

TRL 1.16 applies its importance-sampling correction (``vllm_importance_sampling_*``:
ratio pi_old(y) / P(y) from the rollout's log-probs, truncated or masked, per token or per
sequence) only when ``use_vllm`` is true. This subclass builds TRL with ``use_vllm=False``
(no vLLM engine is created), then turns the correction on for our rollouts: it sets
``use_vllm`` on the instance and puts a small weight-sync object where TRL keeps its vLLM
generation (TRL calls its ``sync_weights()`` before a generation whenever the optimizer
stepped; for us that pushes the weights to the backend). Nothing of TRL's code is copied:
the correction, its loss and its ``sampling/importance_sampling_ratio/*`` metrics are TRL's.

Our correction modes map onto TRL's (``CORRECTION_TO_TRL``):

  token_tis -> token_truncate     w = min(r, cap)              (TRL: clip_max = cap, no clip_min)
  token_mis -> token_mask         w = r in [low, high], else 0
  seq_tis   -> sequence_truncate  w = min(prod r, cap)
  seq_mis   -> sequence_mask      w = prod r in [low, high], else 0
  none      -> correction off (the behaviour log-probs are kept but unused)
  geo_mis   -> refused: TRL has no geometric-mean mode (use trainers.grpo.loop for it).

Our metrics go through TRL's own ``_metrics`` (so they show in its logs and TensorBoard):
``speculative/tau``, ``speculative/relaxed_fraction``, ``speculative/rollout_tokens_per_s``,
``speculative/kl_k1``, ``speculative/kl_k3`` (KL(P || pi) estimated from the sampled tokens)
and ``speculative/is_ess`` (normalised effective sample size of TRL's weights); with the head
training alongside (``RolloutSettings.drafter_training``) also its round's
``speculative/drafter_est_tau``, ``speculative/drafter_est_tau_initial``,
``speculative/drafter_loss`` and ``speculative/drafter_s``, and its state goes into each
checkpoint (``drafter_training.pt``) and back on resume. Each checkpoint also holds the
rollouts' own state (``speculative_rollouts.json``: the generation count, so a resumed run's
seeds continue); both files are written, each atomically, before TRL's, so a checkpoint TRL
completed holds them, and TRL's ``save_total_limit`` rotates them with its folders. Before a
checkpoint the free disk space is checked against its estimated size (the policy's and the
optimizer state's tensors), and a checkpoint whose write fails (out of space, or another write
error) is removed whole (unless its folder was there before this save):
``trainers.grpo.checkpoint.DiskFullError`` / ``CheckpointWriteError`` name the folder and the
last complete checkpoint (``scripts.train_trl`` exits 4). The head's state is read back with
``torch.load(weights_only=True)`` (``load_head_state``): a truncated or foreign file stops the
resume naming it.

A peft LoRA policy (``peft_config=LoraConfig(...)`` or a ``PeftModel``) is sampled through its
merged weights (``trainers.trl.peft_policy``), computed out of place at every weight sync. A
policy sharded over processes (DeepSpeed ZeRO-3, FSDP) is refused when the accelerator is set
up (``sharded_training``): the rollouts need each process's full weights.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from rollout.config import ConfigError
from trainers.drift.stats import drift_stats, effective_sample_size
from trainers.grpo.checkpoint import (failed_write, is_write_failure, load_state, require_space, tensor_bytes,
                                      with_margin, write_atomic)
from trainers.grpo.correction import CorrectionConfig
from trainers.grpo.online_drafter import STATE_FILE
from trainers.trl.peft_policy import is_peft_model
from trainers.trl.rollouts import RolloutSettings, SpeculativeRollouts, process_mean

ROLLOUTS_STATE = "speculative_rollouts.json"  # SpeculativeRollouts.state_dict in each checkpoint
CORRECTION_TO_TRL = {"token_tis": "token_truncate", "token_mis": "token_mask",
                     "seq_tis": "sequence_truncate", "seq_mis": "sequence_mask"}


def trl_correction(cfg: CorrectionConfig) -> dict[str, Any] | None:
    """TRL's ``vllm_importance_sampling_*`` settings for our mode (None: correction off)."""
    if cfg.mode == "none":
        return None
    if cfg.mode not in CORRECTION_TO_TRL:
        raise ConfigError("correction.mode", f"{cfg.mode!r} has no TRL equivalent (TRL has no geometric-mean "
                          "mode); train with scripts.train for it", allowed=["none", *CORRECTION_TO_TRL])
    truncate = cfg.mode.endswith("_tis")
    return {"mode": CORRECTION_TO_TRL[cfg.mode], "clip_min": None if truncate else cfg.low,
            "clip_max": cfg.cap if truncate else cfg.high}


def load_head_state(path: str | os.PathLike) -> dict:
    """The trained head's state saved in a checkpoint, read safely (``trainers.grpo.checkpoint.load_state``:
    ``weights_only=True``); any failure raises ``CheckpointError`` naming the file."""
    return load_state(path, required=("head", "trained_step"), map_location="cpu",
                      advice="resume from another checkpoint, or move this file aside to start the head "
                             "from the configured one")


def _last_complete(run_dir: Path, failed: Path) -> tuple[str, Path | None]:
    """The newest complete TRL checkpoint before ``failed`` (its ``trainer_state.json`` written last), said."""
    done = [p for p in run_dir.glob("checkpoint-*") if p != failed and p.name.split("-")[-1].isdigit()
            and (p / "trainer_state.json").is_file()]
    if not done:
        return "there is no earlier complete checkpoint; the logs are intact", None
    last = max(done, key=lambda p: int(p.name.split("-")[-1]))
    return f"the last complete checkpoint is {last}; it, the earlier ones and the logs are intact", last


def sharded_training(state: Any) -> str | None:
    """What shards the policy's parameters over processes in accelerate's ``state`` (DeepSpeed
    ZeRO-3 or FSDP), None if each process holds them whole (one process, DDP, ZeRO-1/2)."""
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", None) == 3:
        return "DeepSpeed ZeRO-3"
    if getattr(state, "fsdp_plugin", None) is not None:
        return f"FSDP{getattr(state.fsdp_plugin, 'fsdp_version', '')}"
    return None


class _BackendSync:
    """Stands where TRL keeps its vLLM generation: TRL calls ``sync_weights`` after optimizer steps."""

    def __init__(self, trainer: SpeculativeGRPOTrainer):
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.trainer.rollouts.sync(self.trainer)


class SpeculativeGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts come from our speculative backend, with the IS correction on.

    rollouts: our generation settings (``RolloutSettings``) or a ready ``SpeculativeRollouts``.
    correction: our correction config, mapped onto TRL's (see the module docstring).
    Every other argument is GRPOTrainer's; ``args.use_vllm`` must be false.
    """

    def __init__(self, *args: Any, rollouts: RolloutSettings | SpeculativeRollouts,
                 correction: CorrectionConfig = CorrectionConfig(), **kwargs: Any):
        targs = kwargs.get("args", args[2] if len(args) > 2 else None)
        if targs is not None and getattr(targs, "use_vllm", False):
            raise ConfigError("GRPOConfig.use_vllm", "must be false with speculative rollouts: they replace "
                              "TRL's generation (vLLM included)", allowed=[False])
        if kwargs.get("rollout_func") is not None:
            raise ConfigError("rollout_func", "SpeculativeGRPOTrainer supplies its own rollout_func")
        ismap = trl_correction(correction)  # refuse before the model loads
        self.rollouts = rollouts if isinstance(rollouts, SpeculativeRollouts) else SpeculativeRollouts(rollouts)
        self.correction = correction
        super().__init__(*args, rollout_func=self.rollouts, **kwargs)
        self.rollouts.bind(self)  # a bad head or sampling setting fails here, before training
        self.vllm_importance_sampling_correction = ismap is not None
        if ismap is not None:
            self.use_vllm = True  # TRL's gate for its correction; no vLLM engine exists
            self.vllm_generation = _BackendSync(self)
            self._last_loaded_step = -1
            self.vllm_importance_sampling_mode = ismap["mode"]
            self.vllm_importance_sampling_clip_min = ismap["clip_min"]
            self.vllm_importance_sampling_clip_max = ismap["clip_max"]

    def create_accelerator_and_postprocess(self) -> None:
        """Transformers' accelerator set-up, then the refusal of a sharded policy: the rollouts
        generate with (or push) the full weights of the process's own model."""
        super().create_accelerator_and_postprocess()
        sharding = sharded_training(self.accelerator.state)
        if sharding is not None:
            field = "GRPOConfig.deepspeed" if sharding.startswith("DeepSpeed") else "GRPOConfig.fsdp"
            raise ConfigError(field, f"{sharding} (from it or accelerate's config) shards the policy's parameters "
                              "over the processes, "
                              "and speculative rollouts need each process's full weights: use DDP or DeepSpeed "
                              "ZeRO-1/2 (each process holds the whole model), a LoRA adapter (peft_config) to fit "
                              "the memory, or trainers.grpo (scripts.train) for one process",
                              allowed=["DDP", "ZeRO-1", "ZeRO-2"])

    def _generate_and_score_completions(self, inputs):
        if not self.use_vllm:
            self.rollouts.sync(self)  # with the correction off TRL does not call sync_weights
        output = super()._generate_and_score_completions(inputs)
        self._log_rollout_metrics(output)
        return output

    def _log_rollout_metrics(self, output: dict[str, Any]) -> None:
        batch = self.rollouts.last_batch
        if batch is None:
            return
        m = self._metrics["train" if self.model.training else "eval"]
        mask = batch.completion_mask
        values = {"tau": batch.tau, "relaxed_fraction": float((batch.relaxed & mask).sum() / mask.sum().clamp(min=1)),
                  "rollout_tokens_per_s": batch.timings["tokens"] / max(self.rollouts.last_seconds, 1e-9)}
        self._log_drafter_metrics()  # the head's training round before this batch
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is not None and sampled is not None:
            valid = output["completion_mask"].bool()
            stats = drift_stats((old - sampled).float(), valid)
            values.update(kl_k1=stats["kl_k1"], kl_k3=stats["kl_k3"])
            ratio = self.importance_ratios(output)
            if ratio is not None:
                values["is_ess"] = effective_sample_size(ratio[valid])
        for key, value in process_mean(self.accelerator, values).items():  # over the processes, as TRL's own
            m[f"speculative/{key}"].append(value)

    def _log_drafter_metrics(self) -> None:
        """The head's last training round's metrics into TRL's training log (``speculative/drafter_*``),
        flushed with the next log: the next step's, or, after the last step, the final one."""
        m = self._metrics["train"]
        for key, value in self.rollouts.drafter_metrics.items():
            m[f"speculative/{key}"].append(value)
        self.rollouts.drafter_metrics = {}

    # -------------------------------------------------------------- our state in checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        """TRL's checkpoint, preceded by the rollouts' state (``speculative_rollouts.json``) and,
        when the head trains with the policy, the head's (``drafter_training.pt``; its round after
        this step first, where one is due)."""
        self.rollouts.train_drafter(int(self.state.global_step))
        self._log_drafter_metrics()
        if not self.args.should_save:
            super()._save_checkpoint(model, trial)
            return
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"checkpoint-{self.state.global_step}"
        what, advice = f"checkpoint {folder.name}", lambda: _last_complete(run_dir, folder)
        policy = self.accelerator.unwrap_model(model)  # a peft model saves its adapter only: the trained tensors
        weights = [p for p in policy.parameters() if p.requires_grad] if is_peft_model(policy) else policy.state_dict()
        needed = with_margin(tensor_bytes(weights) + tensor_bytes(self.optimizer.state_dict()))
        require_space(run_dir, needed, what, advice)
        new = not folder.exists()  # a folder from before (a save of this step cut short) is not ours to remove
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / ROLLOUTS_STATE, json.dumps(self.rollouts.state_dict()))
            drafter = self.rollouts.drafter
            if drafter is not None:
                head = io.BytesIO()
                torch.save(drafter.state_dict() | {"trained_step": self.rollouts.trained_step}, head)
                write_atomic(folder / f"{STATE_FILE}.pt", head.getvalue())
            super()._save_checkpoint(model, trial)
        except Exception as err:  # a write that failed: the partial checkpoint-N is removed whole
            if not is_write_failure(err):
                raise
            raise failed_write(err, folder, run_dir, what, needed, advice, remove=new) from None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """TRL's resume, plus the rollouts' state and the trained head's (the backend or every
        actor then drafts with it); a checkpoint without them, or a trained head this run does not
        use, is reported."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        name = os.path.basename(os.path.normpath(resume_from_checkpoint))
        path = os.path.join(resume_from_checkpoint, ROLLOUTS_STATE)
        if os.path.isfile(path):
            with open(path) as f:
                self.rollouts.load_state_dict(json.load(f))
        else:
            print(f"warning: {name} holds no {ROLLOUTS_STATE}: the generation seeds start again from the "
                  "run's first", flush=True)
        path = os.path.join(resume_from_checkpoint, f"{STATE_FILE}.pt")
        drafter, settings = self.rollouts.drafter, self.rollouts.settings
        if drafter is not None and os.path.isfile(path):
            self.rollouts.restore_drafter(load_head_state(path))
        elif drafter is not None:
            print(f"warning: {name} holds no trained head ({STATE_FILE}.pt): drafter_training starts again "
                  f"from the configured head ({drafter.head_path})", flush=True)
        elif os.path.isfile(path):
            use = ("and spec.mode 'off' it is not used" if settings.spec.mode == "off" else
                   f"the rollouts draft with the configured head ({settings.drafter_path()}) instead")
            print(f"note: {name} holds the head trained so far ({STATE_FILE}.pt); with drafter_training.every 0 "
                  f"{use}", flush=True)

    def importance_ratios(self, output: dict[str, Any]) -> torch.Tensor | None:
        """TRL's importance-sampling ratios [B, T] of one generation's output (None: off)."""
        ratio = output.get("importance_sampling_ratio")
        if ratio is None:
            return None
        return ratio.expand_as(output["completion_mask"]) if ratio.shape[-1] == 1 else ratio

