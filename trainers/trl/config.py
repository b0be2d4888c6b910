"""The configuration of a TRL GRPO run with our rollouts (``scripts/train_trl.py``).

One YAML file; one frozen dataclass per part, validated before any model loads (errors
name the dotted field). ``trl`` holds ``GRPOConfig`` keyword arguments as they are; the
script fills in what the other sections decide (batch = prompts_per_step x
num_generations, max_steps = run.steps, CPU, fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import ConfigError, check_int, from_dict, load_yaml
from trainers.grpo.config import ModelConfig, TaskConfig
from trainers.grpo.correction import CorrectionConfig
from trainers.tasks.rewards import RewardConfig
from trainers.trl.rollouts import RolloutSettings

GENERATIONS = ("ours", "trl")
#: GRPOConfig fields the script sets from the other sections
OWNED = ("output_dir", "max_steps", "per_device_train_batch_size", "seed", "use_vllm")


@dataclass(frozen=True)
class TRLRunConfig:
    """out_dir: TRL's output_dir and our metrics.jsonl / summary.md / plots. steps: optimizer
    steps. seed: prompts, rollouts and TRL. generation: "ours" (our speculative rollouts)
    or "trl" (TRL's own generation, the baseline of a side-by-side run)."""

    out_dir: str = "runs/trl"
    steps: int = 8
    seed: int = 0
    generation: str = "ours"

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ConfigError("out_dir", f"must be a folder path, got {self.out_dir!r}")
        check_int("steps", self.steps)
        check_int("seed", self.seed, 0)
        if self.generation not in GENERATIONS:
            raise ConfigError("generation", f"unknown generation {self.generation!r}", allowed=GENERATIONS)


@dataclass(frozen=True)
class TRLConfig:
    run: TRLRunConfig = field(default_factory=TRLRunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    trl: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.trl, dict):
            raise ConfigError("trl", f"must be a mapping of GRPOConfig arguments, got {self.trl!r}")
        for name in OWNED:
            if name in self.trl:
                raise ConfigError(f"trl.{name}", "is set by the script from the other sections; remove it")
        _check_trl_args(self.trl, ours=self.run.generation == "ours")
        if self.run.generation == "ours":
            from trainers.trl.trainer import trl_correction

            trl_correction(self.correction)  # geo_mis has no TRL equivalent
        elif self.rollout.drafter_training.enabled:
            raise ConfigError("rollout.drafter_training.every", "trains the head our rollouts draft with; "
                              "run.generation 'trl' uses TRL's own generation, which has no head: set it to 0",
                              allowed=[0])
        if self.model.drafter is None and self.rollout.spec.mode != "off":
            raise ConfigError("rollout.spec.mode", "speculation needs a drafter (model.drafter is null)",
                              allowed=["off"])

    def settings(self) -> RolloutSettings:
        """The rollout settings with the model section's head and the run's seed."""
        from dataclasses import replace

        drafter = self.model.drafter_path()
        return replace(self.rollout, drafter=str(drafter) if drafter else None, target=self.model.target,
                       seed=self.run.seed)


def _check_trl_args(trl_args: dict[str, Any], ours: bool) -> None:
    """Unknown GRPOConfig arguments and sampling settings our rollouts cannot honour, named."""
    import dataclasses
    from types import SimpleNamespace

    from trl import GRPOConfig

    from trainers.trl.rollouts import sampling_from_trl

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(trl_args) - set(fields))
    if unknown:
        raise ConfigError(f"trl.{unknown[0]}", "is not a GRPOConfig argument (TRL 1.16)")
    if not ours:  # TRL's own generation honours every sampling setting
        return
    defaults = {name: f.default for name, f in fields.items() if f.default is not dataclasses.MISSING}
    try:
        sampling_from_trl(SimpleNamespace(**{**defaults, **trl_args}), None)
    except ConfigError as err:
        raise ConfigError(err.field.replace("GRPOConfig.", "trl."), str(err).split(": ", 1)[1]) from None


def load_trl_config(path: str | Path, overrides: dict | None = None) -> TRLConfig:
    from trainers.grpo.config import _merged

    data = _merged(load_yaml(path), overrides or {})
    for key in ("drafter", "target"):
        if isinstance(data.get("rollout"), dict) and key in data["rollout"]:
            raise ConfigError(f"rollout.{key}", f"is model.{key} in this file; move it there")
    return from_dict(TRLConfig, data)
