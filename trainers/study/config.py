"""The study's YAML: the study's own fields, the held-out evaluation, the settings and the base
GRPO config every run starts from.

``load_study_config(path, ...)`` reads and validates it before anything starts; every run's
GRPO config is then built and validated by ``trainers.study.grid.plan_runs``. A bad value raises
:class:`rollout.config.ConfigError` naming the field (``study.seeds``, ``eval.temperatures``,
``settings.mars_tis.correction.mode``, ``train.rollout.spec.mode``) and the allowed values.

Layout::

    study: {out_dir, seeds, reference, parallel, cpus_per_run, gpus_per_run, bootstrap_draws, bootstrap_seed}
    eval: {every, difficulties, problems_per_difficulty, temperatures, max_new_tokens, seed, batch_size}
    settings: {<name>: {verifier, correction, truncation_sampling, overrides}, ...}   # default: the grid below
    train: <a GRPO training config (configs/default.yaml's sections); run.out_dir and run.seed are per run>
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.config import ConfigError, check_int, check_number, from_dict, is_int, is_number, load_yaml
from rollout.params import VerifierConfig
from trainers.grpo.correction import CorrectionConfig
from trainers.tasks.arithmetic import DIFFICULTIES


@dataclass(frozen=True)
class StudySection:
    """out_dir: the study folder (``runs/<setting>/seed<k>/``, ``study.md``, ``study.json``,
        ``plots/``); on a Ray cluster with ``parallel`` > 1, storage every node writes to.
    seeds: the ``run.seed`` of each setting's runs (the same seeds pair runs across settings).
    reference: the setting every other one is compared with.
    parallel: runs at once: 1 trains them one after another in this process; more runs each as
        a Ray task (the local Ray, or the cluster of ``train.ray.address``).
    cpus_per_run, gpus_per_run: what Ray reserves for a run's trainer task when ``parallel`` > 1
        (its rollout actors reserve their own, ``train.rollout``); a trainer on ``cuda`` needs a GPU.
    bootstrap_draws, bootstrap_seed: the report's paired bootstrap (``trainers.study.stats``)."""

    out_dir: str = "runs/study"
    seeds: tuple[int, ...] = (0, 1)
    reference: str = "lossless"
    parallel: int = 1
    cpus_per_run: float = 1.0
    gpus_per_run: float = 0.0
    bootstrap_draws: int = 4000
    bootstrap_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ConfigError("out_dir", f"must be a non-empty path string, got {self.out_dir!r}")
        seeds = self.seeds if isinstance(self.seeds, (list, tuple)) else None
        if not seeds or not all(is_int(s) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ConfigError("seeds", f"must be a non-empty list of distinct integers >= 0, got {self.seeds!r}")
        object.__setattr__(self, "seeds", tuple(seeds))
        if not isinstance(self.reference, str) or not self.reference:
            raise ConfigError("reference", f"must be a setting name, got {self.reference!r}")
        check_int("parallel", self.parallel)
        check_number("cpus_per_run", self.cpus_per_run, 0, low_open=True, finite=True)
        check_number("gpus_per_run", self.gpus_per_run, 0, finite=True)
        check_int("bootstrap_draws", self.bootstrap_draws, 100)
        check_int("bootstrap_seed", self.bootstrap_seed, 0)


@dataclass(frozen=True)
class EvalConfig:
    """every: evaluate the policy every n steps, and always before the first and after the last
        step (0: only those two).
    difficulties: held-out arithmetic levels; problems_per_difficulty: problems of each (the
        held-out split of ``trainers.tasks.arithmetic``, never a training problem).
    temperatures: sampling temperatures of each evaluation (0 = greedy), the policy's full
        distribution at each (no top-k / top-p).
    max_new_tokens: completion cap (null: ``train.rollout.sampling.max_new_tokens``).
    seed: draws the held-out problems and seeds the sampling (the same draws in every run and
        step, so runs are paired by problem and by sampling noise).
    batch_size: prompts per generate call (the draws depend on it: keep it fixed in a study)."""

    every: int = 4
    difficulties: tuple[int, ...] = (1, 2)
    problems_per_difficulty: int = 32
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int | None = None
    seed: int = 1
    batch_size: int = 32

    def __post_init__(self) -> None:
        check_int("every", self.every, 0)
        diffs = self.difficulties if isinstance(self.difficulties, (list, tuple)) else None
        if not diffs or any(d not in DIFFICULTIES for d in diffs) or len(set(diffs)) != len(diffs):
            raise ConfigError("difficulties", f"must be a non-empty list of distinct levels, got {self.difficulties!r}",
                              allowed=DIFFICULTIES)
        object.__setattr__(self, "difficulties", tuple(diffs))
        check_int("problems_per_difficulty", self.problems_per_difficulty)
        temps = self.temperatures if isinstance(self.temperatures, (list, tuple)) else None
        if not temps or not all(is_number(t) and t >= 0 for t in temps) or len(set(temps)) != len(temps):
            raise ConfigError("temperatures", f"must be a non-empty list of distinct numbers >= 0, got "
                              f"{self.temperatures!r}")
        object.__setattr__(self, "temperatures", tuple(float(t) for t in temps))
        if self.max_new_tokens is not None:
            check_int("max_new_tokens", self.max_new_tokens)
        check_int("seed", self.seed, 0)
        check_int("batch_size", self.batch_size)


@dataclass(frozen=True)
class SettingConfig:
    """verifier: the runs' ``rollout.verifier``; correction: their ``correction``.
    truncation_sampling: the verifier's matched baseline instead (``rollout.truncation_sampling``:
        the target sampled from the rule's truncation set, no speculation; typical or min_p).
    overrides: anything else of the base config this setting changes, merged in key by key except
        ``rollout.backend_options``, replaced whole (e.g. ``{rollout: {backend: hf, backend_options:
        {}}}`` runs a truncation baseline on our engine where the base config uses vLLM)."""

    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    correction: CorrectionConfig = field(default_factory=lambda: CorrectionConfig(mode="none"))
    truncation_sampling: bool = False
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.overrides, dict):
            raise ConfigError("overrides", f"must be a mapping of config sections, got {self.overrides!r}")
        if not isinstance(self.truncation_sampling, bool):
            raise ConfigError("truncation_sampling", f"must be true or false, got {self.truncation_sampling!r}")
        for key in ("run", "ray"):
            if key in self.overrides:
                raise ConfigError(f"overrides.{key}", "is the study's, the same for every setting (set it under train)")


MARS = VerifierConfig("mars", {"theta": 0.9}, "law")
OVERSHOOT = VerifierConfig("overshoot", {"lenience": 0.5})
TYPICAL = VerifierConfig("typical", {"epsilon": 0.3, "delta": 0.9})
NONE = CorrectionConfig(mode="none")
TOKEN_TIS = CorrectionConfig(mode="token_tis", cap=2.0)
# the sequence-level mode: geo_mis masks a sequence by its geometric-mean ratio (length-normalised)
# and weights its tokens by truncated IS; seq_mis would test the product of 50-100 token ratios, whose
# spread at these verifiers' drift masks most sequences (the drift study's sequence ESS 0.03-0.13)
GEO_MIS = CorrectionConfig(mode="geo_mis", cap=2.0, low=0.5, high=2.0)

#: the default grid: the lossless reference; MARS theta 0.9 (sampled chains verified towards its law)
#: and overshoot lenience 0.5, each with no correction, token TIS and geo_mis; typical with and without
#: token TIS, beside its matched baseline (typical sampling on the target, no speculation)
DEFAULT_SETTINGS: dict[str, SettingConfig] = {
    "lossless": SettingConfig(VerifierConfig("lossless"), NONE),
    "mars_none": SettingConfig(MARS, NONE),
    "mars_tis": SettingConfig(MARS, TOKEN_TIS),
    "mars_geo": SettingConfig(MARS, GEO_MIS),
    "overshoot_none": SettingConfig(OVERSHOOT, NONE),
    "overshoot_tis": SettingConfig(OVERSHOOT, TOKEN_TIS),
    "overshoot_geo": SettingConfig(OVERSHOOT, GEO_MIS),
    "typical_none": SettingConfig(TYPICAL, NONE),
    "typical_tis": SettingConfig(TYPICAL, TOKEN_TIS),
    "typical_sampling": SettingConfig(TYPICAL, NONE, truncation_sampling=True),
}


@dataclass(frozen=True)
class StudyConfig:
    """study, eval: above. settings: name -> SettingConfig, in run order (default
    :data:`DEFAULT_SETTINGS`). train: the base GRPO config, as a mapping (validated per run)."""

    study: StudySection = field(default_factory=StudySection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    settings: dict = field(default_factory=lambda: dict(DEFAULT_SETTINGS))
    train: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        settings = self.settings
        if not isinstance(settings, dict) or not settings:
            raise ConfigError("settings", f"must be a non-empty mapping of setting names, got {settings!r}")
        parsed = {}
        for name, value in settings.items():
            if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
                raise ConfigError("settings", f"setting name {name!r} must be letters, digits, '_' or '-' "
                                  "(it names a folder)")
            parsed[name] = value if isinstance(value, SettingConfig) else from_dict(SettingConfig, value,
                                                                                     f"settings.{name}")
        object.__setattr__(self, "settings", parsed)
        if self.study.reference not in parsed:
            raise ConfigError("study.reference", f"{self.study.reference!r} is not a setting", allowed=list(parsed))
        if not isinstance(self.train, dict):
            raise ConfigError("train", f"must be a mapping (a GRPO training config), got {self.train!r}")
        run = self.train.get("run") or {}
        for key in ("out_dir", "seed"):
            if isinstance(run, dict) and key in run:
                where = "study.out_dir" if key == "out_dir" else "study.seeds"
                raise ConfigError(f"train.run.{key}", f"is set per run ({where})")
        task = self.train.get("task") or {}
        if isinstance(task, dict) and task.get("source", "arithmetic") != "arithmetic":
            raise ConfigError("train.task.source", "the held-out evaluation draws arithmetic problems",
                              allowed=["arithmetic"])

    def subset(self, names: list[str]) -> StudyConfig:
        """This study restricted to the settings ``names`` (in grid order); an unknown name raises."""
        unknown = [n for n in names if n not in self.settings]
        if unknown:
            raise ConfigError("settings", f"unknown setting(s) {', '.join(unknown)}", allowed=list(self.settings))
        if self.study.reference not in names:
            raise ConfigError("settings", f"a subset must include the reference setting {self.study.reference!r} "
                              "(every comparison is against it)", allowed=list(self.settings))
        keep = {n: s for n, s in self.settings.items() if n in names}
        return StudyConfig(self.study, self.eval, keep, self.train)


def load_study_config(path, *, settings: list[str] | None = None, seeds: list[int] | None = None,
                      steps: int | None = None, out_dir: str | None = None,
                      eval_problems: int | None = None) -> StudyConfig:
    """Read and validate a study YAML; the keyword arguments override it (the CLI's smoke flags):
    a subset of the settings, the seeds, ``train.run.steps``, ``study.out_dir`` and
    ``eval.problems_per_difficulty``."""
    data = dict(load_yaml(path))
    for keys, value in ((("study", "seeds"), seeds), (("study", "out_dir"), out_dir),
                        (("eval", "problems_per_difficulty"), eval_problems), (("train", "run", "steps"), steps)):
        if value is not None:
            data = _with(data, keys, value)
    cfg = from_dict(StudyConfig, data)
    return cfg.subset(settings) if settings is not None else cfg


def _with(data: dict, keys: tuple[str, ...], value) -> dict:
    """``data`` with ``value`` at the nested ``keys`` (a section that is not a mapping is left for
    the validator to refuse)."""
    section = data.get(keys[0])
    if len(keys) == 1:
        return {**data, keys[0]: value}
    if section is not None and not isinstance(section, dict):
        return data
    return {**data, keys[0]: _with(section or {}, keys[1:], value)}
