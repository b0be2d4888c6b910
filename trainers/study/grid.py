"""The study's runs (settings x seeds) and the comparisons its report makes.

- **run order**: seed by seed, every setting of a seed before the next seed, so a study cut short
  still holds complete pairs.
- **run config**: the base config (``train:``) with the setting's verifier, correction and
  truncation baseline (no speculation there), then its ``overrides`` (merged key by key, except a
  ``rollout.backend_options`` mapping, which replaces the base's whole: its options belong to its
  backend), then the run's seed and folder; validated as a :class:`trainers.grpo.config.TrainConfig`
  (and its files checked) here, before anything trains. A bad field is named with its setting.
- **comparisons** (:func:`comparisons`): each setting against the reference; a corrected setting
  against the same rollouts uncorrected; a truncation rule against its matched baseline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rollout.config import ConfigError, from_dict
from rollout.params import TRUNCATION_RULES
from trainers.grpo.config import TrainConfig, _merged
from trainers.study.config import SettingConfig, StudyConfig

KINDS = ("reference", "uncorrected", "baseline")


@dataclass(frozen=True)
class RunPlan:
    """One run of the grid: ``index`` of ``total`` in run order (1-based)."""

    index: int
    total: int
    setting: str
    seed: int
    config: TrainConfig

    @property
    def out_dir(self) -> Path:
        return Path(self.config.run.out_dir)

    @property
    def label(self) -> str:
        return f"{self.setting} seed {self.seed}"


def run_dir(study_dir: str | Path, setting: str, seed: int) -> Path:
    """The folder of one run: ``<study_dir>/runs/<setting>/seed<k>``."""
    return Path(study_dir) / "runs" / setting / f"seed{seed}"


def run_config(cfg: StudyConfig, setting: str, seed: int) -> TrainConfig:
    """The validated GRPO config of ``setting`` at ``seed`` (see the module docstring)."""
    from trainers.grpo.preflight import check_files

    s = cfg.settings[setting]
    rollout = {"verifier": dataclasses.asdict(s.verifier), "truncation_sampling": s.truncation_sampling}
    if s.truncation_sampling:
        rollout["spec"] = {"mode": "off"}
    data = _merged(cfg.train, {"rollout": rollout, "correction": dataclasses.asdict(s.correction)})
    data = _merged(data, s.overrides)
    options = (s.overrides.get("rollout") or {}).get("backend_options")
    if isinstance(options, dict):  # the options belong to the backend: replaced whole, not merged
        data["rollout"] = {**data["rollout"], "backend_options": options}
    data = _merged(data, {"run": {"out_dir": str(run_dir(cfg.study.out_dir, setting, seed)), "seed": seed}})
    try:
        train = from_dict(TrainConfig, data)
        check_files(train)
    except ConfigError as err:
        raise ConfigError(f"settings.{setting} -> train.{err.field}", str(err).split(": ", 1)[1]) from None
    return train


def plan_runs(cfg: StudyConfig) -> list[RunPlan]:
    """Every run of the study, in run order (seed by seed), each with its validated config."""
    pairs = [(name, seed) for seed in cfg.study.seeds for name in cfg.settings]
    return [RunPlan(i, len(pairs), name, seed, run_config(cfg, name, seed)) for i, (name, seed) in enumerate(pairs, 1)]


@dataclass(frozen=True)
class Comparison:
    """``setting`` minus ``other``; kind: ``reference`` (against the reference setting),
    ``uncorrected`` (the same rollouts without correction: what the correction buys back) or
    ``baseline`` (a truncation rule against truncation sampling on the target)."""

    setting: str
    other: str
    kind: str


def _same_rollouts(a: SettingConfig, b: SettingConfig) -> bool:
    return a.verifier == b.verifier and a.truncation_sampling == b.truncation_sampling and a.overrides == b.overrides


def _same_rule(a: SettingConfig, b: SettingConfig) -> bool:
    return a.verifier.name == b.verifier.name and a.verifier.rule() == b.verifier.rule()


def comparisons(cfg: StudyConfig) -> list[Comparison]:
    """The report's comparisons, per setting in grid order: against the reference, against its
    uncorrected rollouts (a setting with a correction whose rollouts also run with mode none), and
    against its matched baseline (a typical / min_p verifier whose truncation sampling is in the
    grid: the one with the same correction, else the uncorrected one)."""
    ref = cfg.study.reference
    out: list[Comparison] = []
    items = list(cfg.settings.items())
    for name, s in items:
        if name != ref:
            out.append(Comparison(name, ref, "reference"))
        if s.correction.mode != "none":
            bare = [n for n, t in items if t.correction.mode == "none" and _same_rollouts(s, t)]
            if bare and bare[0] != ref:
                out.append(Comparison(name, bare[0], "uncorrected"))
        if s.verifier.name in TRUNCATION_RULES and not s.truncation_sampling:
            bases = [(n, t) for n, t in items if t.truncation_sampling and _same_rule(s, t)]
            same = [n for n, t in bases if t.correction == s.correction]
            none = [n for n, t in bases if t.correction.mode == "none"]
            if same or none:
                out.append(Comparison(name, (same or none)[0], "baseline"))
    return out
