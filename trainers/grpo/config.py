"""The configuration of a GRPO training run: one YAML file, one frozen dataclass per part.

``load_train_config(path)`` reads the YAML, builds :class:`TrainConfig` and validates every
field before anything expensive starts (no Ray, no model load): an unknown key, a bad
value, a missing model or drafter file raises :class:`rollout.config.ConfigError` naming
the field (dotted path, e.g. ``rollout.verifier.name``) and the allowed values.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from rollout.backend import BACKENDS, check_backend_options
from rollout.config import ConfigError, check_int, check_number, from_dict, is_int, is_number, load_yaml
from rollout.models import TargetConfig
from rollout.params import (TRUNCATION_RULES, SamplingParams, SpecConfig, TruncationSamplingConfig, VerifierConfig,
                            check_test, drift_warning)
from trainers.grpo.correction import CorrectionConfig
from trainers.grpo.loss import GRPOConfig
from trainers.grpo.online_drafter import OnlineDrafterConfig
from trainers.tasks.arithmetic import DIFFICULTIES
from trainers.tasks.rewards import RewardConfig

TASK_SOURCES = ("arithmetic", "jsonl")
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class RunConfig:
    """out_dir: where metrics, TensorBoard events, checkpoints and plots go.
    steps: optimizer steps. seed: seeds prompts, rollouts and the trainer.
    checkpoint_every: save every n steps (and at the end); 0 = only at the end.
    keep_checkpoints: the newest n complete checkpoints stay, older ones are removed once a newer
        one is complete (trainers/grpo/checkpoint.py); null = keep all. A checkpoint of the
        embedded SmolLM2-135M holds its fp32 weights and AdamW's two moments (see configs/default.yaml).
    resume: continue from the newest checkpoint in out_dir when there is one; false (the
        CLI's --fresh) moves the old checkpoints aside (run_dir.py) and starts at step 0.
    device: where the trainer's policy lives: "cpu", "cuda" or "auto" (cuda when present).
    allow_config_change: resume even when the seed, model, sampling, verifier, task or loss
        settings differ from the run folder's config snapshot (refused by default)."""

    out_dir: str = "runs/default"
    steps: int = 8
    seed: int = 0
    checkpoint_every: int = 2
    keep_checkpoints: int | None = 2
    resume: bool = True
    device: str = "cpu"
    allow_config_change: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ConfigError("out_dir", f"must be a non-empty path string, got {self.out_dir!r}")
        object.__setattr__(self, "out_dir", os.path.expanduser(self.out_dir))  # "~/runs/x": the home folder
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError("out_dir", f"{self.out_dir!r} exists and is not a folder")
        check_int("steps", self.steps)
        check_int("seed", self.seed, 0)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        if self.keep_checkpoints is not None and (not is_int(self.keep_checkpoints) or self.keep_checkpoints < 1):
            raise ConfigError("keep_checkpoints", f"must be an integer >= 1 (the newest checkpoints kept) or null "
                              f"(keep all), got {self.keep_checkpoints!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"unknown device {self.device!r}", allowed=DEVICES)
        if not isinstance(self.resume, bool):
            raise ConfigError("resume", f"must be true or false, got {self.resume!r}")
        if not isinstance(self.allow_config_change, bool):
            raise ConfigError("allow_config_change", f"must be true or false, got {self.allow_config_change!r}")


@dataclass(frozen=True)
class ModelConfig:
    """target: the policy (TargetConfig; path null = embedded SmolLM2-135M-Instruct).
    drafter: an EAGLE-3 head folder, "default" for the shipped head, or null (no head:
    rollout.spec.mode must then be "off")."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: str | None = "default"

    def __post_init__(self) -> None:
        if self.drafter not in (None, "default"):
            if not isinstance(self.drafter, str) or not (Path(self.drafter) / "config.json").is_file():
                raise ConfigError("drafter", f"no EAGLE-3 head (config.json) at {self.drafter!r}",
                                  allowed=["default", "null", "a head folder"])

    def drafter_path(self) -> Path | None:
        if self.drafter is None:
            return None
        if self.drafter == "default":
            from rollout.eagle3 import default_head_path

            return default_head_path()
        return Path(self.drafter)


@dataclass(frozen=True)
class RolloutConfig:
    """backend: "hf" (our engine) or "vllm" (vLLM with our verifier, ``rollout.vllm``; chain or
    off only). backend_options: options only that backend reads (hf: linear, weights (exact or
    bfloat16, see rollout.engine.backend.HFBackend); vllm: kv_cache_memory_bytes,
    enforce_eager, max_model_len, max_num_seqs, ... see ``rollout.vllm.backend``).
    num_actors: Ray rollout actors; threads_per_actor: torch threads in each.
    num_gpus_per_actor: GPUs Ray reserves for each actor; > 0 runs its engine on cuda.
    max_restarts: how often a dead actor is restarted within one step before giving up.
    actor_timeout_s: a generate or set_weights call that has not returned after this long
        counts as a hung actor: it is killed and replaced like a dead one.
    truncation_sampling: true runs the verifier's matched baseline instead of the verifier: no
        speculation (spec.mode 'off'), every token sampled from p restricted to the truncation set
        A of ``verifier`` (typical or min_p; ``rollout.params.TruncationSamplingConfig``), its
        behaviour log-prob log p(y) - log p(A) exact; hf backend only (vLLM samples plain tokens from p)."""

    backend: str = "hf"
    backend_options: dict = field(default_factory=dict)
    num_actors: int = 1
    threads_per_actor: int = 2
    num_gpus_per_actor: float = 0.0
    max_restarts: int = 2
    actor_timeout_s: float = 1800.0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecConfig = field(default_factory=SpecConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    truncation_sampling: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"unknown backend {self.backend!r}", allowed=tuple(BACKENDS))
        if not isinstance(self.backend_options, dict):
            raise ConfigError("backend_options", f"must be a mapping, got {self.backend_options!r}")
        check_backend_options(self.backend, self.backend_options)  # here, not first in a Ray actor
        if self.backend == "vllm" and self.spec.mode == "tree":
            raise ConfigError("spec.mode", "vLLM has no tree drafting; use 'chain' or 'off' with backend vllm")
        check_test(self.spec, self.verifier, self.sampling.temperature)
        if (message := drift_warning(self.spec, self.verifier)) is not None:
            warnings.warn(f"rollout: {message}", stacklevel=2)
        check_int("num_actors", self.num_actors)
        check_int("threads_per_actor", self.threads_per_actor)
        check_int("max_restarts", self.max_restarts, 0)
        check_number("actor_timeout_s", self.actor_timeout_s, 0, low_open=True, finite=True)
        check_number("num_gpus_per_actor", self.num_gpus_per_actor, 0, finite=True)
        if not isinstance(self.truncation_sampling, bool):
            raise ConfigError("truncation_sampling", f"must be true or false, got {self.truncation_sampling!r}")
        if self.truncation_sampling:
            if self.verifier.name not in TRUNCATION_RULES:
                raise ConfigError("verifier.name", f"truncation_sampling samples from the truncation set of the "
                                  f"verifier's rule; {self.verifier.name!r} has none", allowed=TRUNCATION_RULES)
            if self.spec.mode != "off":
                raise ConfigError("spec.mode", "truncation_sampling samples without speculation",
                                  allowed=["off"])
            if self.backend != "hf":
                raise ConfigError("backend", "truncation_sampling needs our engine (vLLM samples plain tokens "
                                  "from p)", allowed=["hf"])

    @property
    def behaviour_verifier(self) -> VerifierConfig:
        """The verifier the rollout actors run: ``verifier``, or its truncation baseline."""
        if self.truncation_sampling:
            return TruncationSamplingConfig(self.verifier.name, dict(self.verifier.params))
        return self.verifier


@dataclass(frozen=True)
class TaskConfig:
    """source: "arithmetic" (procedural word problems) or "jsonl" (GSM8K-format file at path).
    difficulty: 1..4 for arithmetic. prompts_per_step: distinct prompts per step (each
    repeated grpo.group_size times). system_prompt: optional system message."""

    source: str = "arithmetic"
    difficulty: int = 1
    path: str | None = None
    prompts_per_step: int = 4
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.source not in TASK_SOURCES:
            raise ConfigError("source", f"unknown task source {self.source!r}", allowed=TASK_SOURCES)
        if self.source == "arithmetic" and self.difficulty not in DIFFICULTIES:
            raise ConfigError("difficulty", f"got {self.difficulty!r}", allowed=DIFFICULTIES)
        if self.source == "jsonl" and (self.path is None or not Path(self.path).is_file()):
            raise ConfigError("path", f"JSONL task file not found: {self.path!r}")
        check_int("prompts_per_step", self.prompts_per_step)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW: lr, weight_decay, betas; grad_clip: max grad norm (0 = off);
    micro_batch: sequences per forward/backward (memory bound); share_prompts: rows of a
    micro-batch that repeat a prompt (a GRPO group) run it once, by its KV cache or packed
    into one sequence, whichever costs less (``trainers/grpo/forward_plan.py``; the same
    log-probs and gradient up to float rounding; false runs every row whole)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    micro_batch: int = 8
    share_prompts: bool = True

    def __post_init__(self) -> None:
        check_number("lr", self.lr, 0, low_open=True, finite=True)
        check_number("weight_decay", self.weight_decay, 0, finite=True)
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        check_number("grad_clip", self.grad_clip, 0, finite=True)  # NaN would silently mean "no clipping"
        check_int("micro_batch", self.micro_batch)
        if not isinstance(self.share_prompts, bool):
            raise ConfigError("share_prompts", f"must be true or false, got {self.share_prompts!r}")


@dataclass(frozen=True)
class RayConfig:
    """address: null starts a local Ray; "auto" joins the cluster of `ray job submit`.
    num_cpus: CPUs of the local Ray (null = all)."""

    address: str | None = None
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ConfigError("address", f"must be null, \"auto\" or a cluster address string, got {self.address!r}")
        if self.num_cpus is not None:
            check_int("num_cpus", self.num_cpus)


@dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    drafter_training: OnlineDrafterConfig = field(default_factory=OnlineDrafterConfig)

    def __post_init__(self) -> None:
        if self.model.drafter is None and self.rollout.spec.mode != "off":
            raise ConfigError("rollout.spec.mode", "speculation needs a drafter (model.drafter is null)",
                              allowed=["off"])
        if self.drafter_training.enabled and (self.model.drafter is None or self.rollout.spec.mode == "off"):
            raise ConfigError("drafter_training.every", "trains the EAGLE-3 head the rollouts draft with; there is "
                              f"none (model.drafter {self.model.drafter!r}, rollout.spec.mode "
                              f"{self.rollout.spec.mode!r}): set it to 0", allowed=[0])
        if self.rollout.backend == "vllm" and str(self.model.target.path or "").endswith(".gguf"):
            raise ConfigError("model.target.path", "the vllm backend needs a Hugging Face model folder, not a GGUF "
                              "file (null: the embedded model, whose safetensors cache it reads)")
        if self.model.target.dtype != "float32":
            raise ConfigError("model.target.dtype", f"{self.model.target.dtype!r} would train the policy itself in "
                              "that dtype, with no fp32 copy (a bf16 step of lr ~1e-5 mostly rounds to no change); "
                              "train in float32 and round the rollout copies instead (rollout.backend_options: "
                              "{weights: bfloat16})", allowed=["float32"])
        if self.rollout.sampling.temperature <= 0:
            raise ConfigError("rollout.sampling.temperature", "must be > 0 for training: the policy log-probs "
                              f"and importance weights need a sampling distribution, got {self.rollout.sampling.temperature}")

    @property
    def rollouts_per_step(self) -> int:
        return self.task.prompts_per_step * self.grpo.group_size


def load_train_config(path: str | Path, overrides: dict | None = None) -> TrainConfig:
    """Read and validate a training YAML; ``overrides`` ({"run": {"steps": 2}}) are merged in
    key by key at every depth ({"rollout": {"spec": {"max_batch": 4}}} keeps the other spec
    keys), except that a rule's ``params`` mapping is replaced whole (they belong to its name)."""
    from trainers.grpo.preflight import check_files

    cfg = from_dict(TrainConfig, _merged(load_yaml(path), overrides or {}))
    check_files(cfg)
    return cfg


def _merged(data: dict, overrides: dict) -> dict:
    out = dict(data or {})
    for key, value in overrides.items():
        deep = isinstance(value, dict) and key != "params"
        base = out.get(key)
        if not deep:
            out[key] = value
        elif base is None or isinstance(base, dict):
            out[key] = _merged(base or {}, value)
        # else: the file's section is not a mapping; keep it for the validator to refuse
    return out
