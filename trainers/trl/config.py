"""The configuration of a TRL GRPO run with our rollouts (``scripts/train_trl.py``).

One YAML file; one frozen dataclass per part, validated before any model loads (errors
name the dotted field). ``trl`` holds ``GRPOConfig`` keyword arguments as they are; the
script fills in what the other sections decide (batch = prompts_per_step x
num_generations completions per step, split evenly over the processes ``accelerate launch``
started, ``launch_processes``; max_steps = run.steps, seed = run.seed, the CPU unless CUDA is
there, bf16 autocast only for a bfloat16 policy unless ``trl.bf16`` says otherwise), and TRL's
``GRPOConfig`` is built from both when the config loads, so TRL's own checks run
then too. The rollouts' target and seed are ``model.target`` and ``run.seed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import ConfigError, check_int, check_leaf, from_dict, load_yaml
from trainers.grpo.config import ModelConfig, TaskConfig
from trainers.grpo.correction import CorrectionConfig
from trainers.tasks.rewards import RewardConfig
from trainers.trl.arg_ranges import check_ranges
from trainers.trl.rollouts import RolloutSettings

GENERATIONS = ("ours", "trl")
#: GRPOConfig fields the script sets from the other sections (reward_weights: the answer reward 1,
#: the logged accuracy 0, ``trainers.trl.run.reward_functions``)
OWNED = ("output_dir", "max_steps", "per_device_train_batch_size", "seed", "use_vllm", "use_cpu", "reward_weights")
#: policy dtypes TRL trains (float16 would need a loss scaler, which CPUs do not run)
POLICY_DTYPES = ("float32", "bfloat16")
#: GRPOConfig fields of TRL's importance-sampling correction (with vLLM only): our correction section's
CORRECTION_PREFIX = "vllm_importance_sampling_"


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
        for name in sorted(self.trl):
            if name.startswith(CORRECTION_PREFIX):
                raise ConfigError(f"trl.{name}", "is set from the correction section (mode, cap, low, high) with "
                                  "run.generation 'ours'; TRL's own generation here has no vLLM, so TRL applies no "
                                  "correction: remove it")
        if self.rollout.drafter_training.enabled and launch_processes() > 1:
            raise ConfigError("rollout.drafter_training.every", f"trains the head in one process; the "
                              f"{launch_processes()} processes launched would each train their own: set it to 0",
                              allowed=[0])
        _check_trl_args(self)
        if self.model.target.dtype not in POLICY_DTYPES:
            raise ConfigError("model.target.dtype", f"{self.model.target.dtype!r} is not a dtype TRL trains here "
                              "(trl.bf16: true with float32 is mixed precision over fp32 weights)",
                              allowed=POLICY_DTYPES)
        if self.model.target.dtype == "bfloat16":
            import warnings

            warnings.warn("model.target.dtype 'bfloat16' trains the bf16 weights themselves, with no fp32 master copy: "
                          "an update smaller than about 1/256 of a weight rounds away (a small learning rate's mostly "
                          "does); float32 with trl.bf16: true computes in bf16 over fp32 weights", stacklevel=2)
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


    def grpo_arguments(self) -> dict[str, Any]:
        """GRPOConfig's keyword arguments: the trl section and what the script sets (``OWNED``)."""
        import torch

        n_gen = self.trl.get("num_generations", _grpo_fields()["num_generations"].default)
        return dict(output_dir=self.run.out_dir, max_steps=self.run.steps, seed=self.run.seed,
                    per_device_train_batch_size=self.task.prompts_per_step * n_gen // launch_processes(),
                    use_cpu=not torch.cuda.is_available(),
                    **{"bf16": self.model.target.dtype == "bfloat16", **self.trl})  # trl.bf16: mixed precision

    def grpo_config(self):
        """TRL's ``GRPOConfig`` of this run (``grpo_arguments``)."""
        from trl import GRPOConfig

        return GRPOConfig(**self.grpo_arguments())


def launch_processes() -> int:
    """The processes of this run: ``WORLD_SIZE`` as ``accelerate launch`` and ``torchrun`` set it
    (1 in a plain ``python`` process)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def _grpo_fields() -> dict[str, Any]:
    import dataclasses

    from trl import GRPOConfig

    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _check_trl_args(cfg: TRLConfig) -> None:
    """The trl section as TRL will take it, each failure named ``trl.<argument>``: unknown
    arguments, values of the wrong kind (a string learning rate, 3.5 tokens), each numeric
    argument's range (``trainers.trl.arg_ranges``: TRL's, transformers' and torch's bounds, some
    of which they check only once training starts), GRPOConfig's own checks with the arguments the
    script adds, and the sampling settings our rollouts cannot honour."""
    import warnings

    from trainers.trl.rollouts import sampling_from_trl

    fields = _grpo_fields()
    unknown = sorted(set(cfg.trl) - set(fields))
    if unknown:
        raise ConfigError(f"trl.{unknown[0]}", "is not a GRPOConfig argument (TRL 1.16)")
    for name, value in cfg.trl.items():
        check_leaf(f"trl.{name}", fields[name].type, value)  # float / int / str / bool fields
    check_ranges(cfg.trl, fields)  # each numeric argument's range, before TRL or torch meet it
    n_gen = cfg.trl.get("num_generations", fields["num_generations"].default)
    check_int("trl.num_generations", n_gen, 2)
    if (cfg.task.prompts_per_step * n_gen) % launch_processes():
        raise ConfigError("task.prompts_per_step", f"{cfg.task.prompts_per_step} prompts x {n_gen} generations = "
                          f"{cfg.task.prompts_per_step * n_gen} completions per step do not split evenly over the "
                          f"{launch_processes()} processes launched")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's deprecation notes show when the run builds it
            args = cfg.grpo_config()
    except (ValueError, TypeError) as err:
        name, text = _culprit(cfg, err), str(err)
        if "global batch size" in text:
            text += (f" (per_device_train_batch_size is task.prompts_per_step x num_generations = "
                     f"{cfg.grpo_arguments()['per_device_train_batch_size']})")
        raise ConfigError(f"trl.{name}" if name else "trl", f"refused by GRPOConfig: {text}") from None
    if cfg.run.generation != "ours":  # TRL's own generation honours every sampling setting
        return
    try:
        sampling_from_trl(args, None)
    except ConfigError as err:
        raise ConfigError(err.field.replace("GRPOConfig.", "trl."), str(err).split(": ", 1)[1]) from None


def _culprit(cfg: TRLConfig, err: Exception) -> str | None:
    """The trl argument GRPOConfig refused: the one its message names, else the first that fails
    alone (with num_generations, which the batch size depends on); None if none does."""
    import re
    import warnings

    from trl import GRPOConfig

    named = [n for n in cfg.trl if re.search(rf"(?<!\w){re.escape(n)}(?!\w)", str(err))]
    if named:
        return max(named, key=len)
    args = cfg.grpo_arguments()
    base = {k: v for k, v in args.items() if k not in cfg.trl or k == "num_generations"}
    for name in cfg.trl:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                GRPOConfig(**{**base, name: args[name]})
        except (ValueError, TypeError):
            return name
    return None


def load_trl_config(path: str | Path, overrides: dict | None = None) -> TRLConfig:
    """Read and validate a TRL run YAML (``overrides`` merged in as ``load_train_config`` does),
    then check its task file and head the way ``scripts.train`` does (``preflight.check_files``)."""
    from trainers.grpo.config import _merged
    from trainers.grpo.preflight import check_files

    data = _merged(load_yaml(path), overrides or {})
    rollout = data.get("rollout")
    if isinstance(rollout, dict):
        for key, where in (("drafter", "model.drafter"), ("target", "model.target"), ("seed", "run.seed")):
            if key in rollout:
                raise ConfigError(f"rollout.{key}", f"is {where} in this file; move it there")
        # the actors of placement 'ray' load model.target: validated as model.* first, then handed on
        from_dict(ModelConfig, data.get("model"), "model")
        data["rollout"] = {**rollout, "target": (data.get("model") or {}).get("target") or {}}
    cfg = from_dict(TRLConfig, data)
    check_files(cfg)
    return cfg
