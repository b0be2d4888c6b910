"""Drift diagnostics: what each verifier does to the sampling distribution, the speed and the task.

Vocabulary (verifier terms as in ``verifiers``: p, q, induced distribution P, behaviour log-prob):
- **configuration**: one (verifier, speculation mode) pair, or one matched baseline.
- **matched baseline**: plain sampling from the target, no speculation, with the same
  truncation set A as the rule (the lossy-verification study's point: a truncation rule's
  speed and accuracy must be compared with truncation *sampling* on the target, not with
  plain sampling). ``min_p`` and ``typical`` rules are matched with sampling from p
  restricted to their A (for ``typical`` that is eta-style sampling); every other rule,
  including the min-p-gated overshoot cap (its P keeps the full support of p: the gate only
  changes acceptance inside A), is matched with plain target sampling ("plain"), which is
  also the lossless rule without speculation. When the gated overshoot's own min-p set was
  run as a baseline, it is reported as a secondary comparison.
- **per-token drift**: at each emitted token's position, TV(P, p), KL(P || p), H(P), H(p)
  and the uncovered mass (the untruncated target's mass on {P == 0}), from the closed-form P
  of ``verifiers.induced_chain`` / ``induced_candidates`` at the exact logits the verifier
  saw (``Engine.generate(debug=True)``). Baselines' P is p restricted to A.
- **sequence log importance ratio**: sum_t (log p(y_t) - log P(y_t)) over a completion; the
  weights exp(.) have an effective sample size ESS = (sum w)^2 / (n sum w^2) in [0, 1].

This module holds the study's config, the verifier specs and the matched baselines;
``trainers.drift.run`` generates and reduces, ``trainers.drift.stats`` holds the statistics,
``trainers.drift.report`` writes the JSON and tables (and reads training runs), ``trainers.drift.plots`` draws them.
Timings are taken with ``debug=True`` for every configuration alike (the record copies
cost a few percent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import ConfigError, check_int
from rollout.params import (TRUNCATION_RULES, SamplingParams, SpecConfig, TruncationSamplingConfig, VerifierConfig,
                            check_test)

SOURCES = ("tasks", "jsonl", "general")
MODES = ("chain", "tree")
SPEED_BASES = ("wall", "cpu")
DEFAULT_VERIFIERS = ("lossless", "mars:theta=0.9", "mars:theta=0.7", "overshoot:lenience=0.5",
                     "overshoot:lenience=0.5,min_p=0.1", "typical:epsilon=0.3,delta=0.9", "min_p:p_base=0.1")
PLAIN = "plain"


# ----------------------------------------------------------------------------- verifier specs
def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"parameter value {text!r} is not a number") from None


def parse_verifier(spec: str | dict) -> VerifierConfig:
    """``"name"`` or ``"name:k=v,k=v"`` (or a mapping ``{name, params, test}``) -> VerifierConfig;
    the key ``test`` sets ``VerifierConfig.test`` (``mars:theta=0.9,test=law``), the others are
    the rule's parameters."""
    if isinstance(spec, dict):
        return VerifierConfig(spec.get("name"), dict(spec.get("params") or {}), spec.get("test", "rule"))
    name, _, rest = str(spec).partition(":")
    params, test = {}, "rule"
    for part in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = part.partition("=")
        if not eq:
            raise ValueError(f"verifier {spec!r}: parameter {part!r} must be key=value")
        if key.strip() == "test":
            test = val.strip()
        else:
            params[key.strip()] = _value(val)
    return VerifierConfig(name.strip(), params, test)


def verifier_label(v: VerifierConfig) -> str:
    """Canonical spec string: ``name`` or ``name:k=v,...`` (parameters in given order, then
    ``test=law`` where it is not the default)."""
    items = [f"{k}={_fmt(x)}" for k, x in v.params.items()] + ([f"test={v.test}"] if v.test != "rule" else [])
    return v.name + (":" + ",".join(items) if items else "")


def _fmt(x: Any) -> str:
    return "none" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DriftConfig:
    """One drift study (``configs/drift.yaml``).

    source: ``tasks`` (arithmetic problems), ``jsonl`` (``jsonl_path``) or ``general``
        (general instructions, no accuracy). difficulties: task levels (1..4) for ``tasks``.
    prompts: prompts per configuration, split evenly over the difficulties.
    split / prompt_seed: which problems are drawn.
    verifiers: spec strings (see :func:`parse_verifier`); lossless is added when missing (it
        is the speed reference). modes: speculative modes (chain, tree); chain / tree: their
        SpecConfig. baselines: also run the matched baselines (mode off).
    temperature, top_k, top_p, max_new_tokens: target sampling (stop at the tokenizer's EOS).
    batch_size: prompts per ``generate`` call; seed: generation seed (batch i uses seed + i).
    target: model folder or .gguf (null = the embedded SmolLM2); head: ``default`` (the
        shipped head), ``random`` (a random head sharing the target's lm_head) or a folder.
    num_threads: torch threads (null = all cores); out: output directory.
    speed_basis: ``wall`` (tokens per second) or ``cpu`` (tokens per CPU-second of the
        generate calls: fairer on a shared machine, best with num_threads 1): which speedup
        the table and the speed plot show (the JSON has both).
    """

    source: str = "tasks"
    difficulties: tuple[int, ...] = (1, 2)
    prompts: int = 200
    jsonl_path: str | None = None
    split: str = "heldout"
    prompt_seed: int = 0
    verifiers: tuple[str, ...] = DEFAULT_VERIFIERS
    modes: tuple[str, ...] = ("chain",)
    chain: SpecConfig = field(default_factory=lambda: SpecConfig(mode="chain", num_draft_tokens=5))
    tree: SpecConfig = field(default_factory=lambda: SpecConfig(mode="tree", depth=5, top_k=4, total_tokens=16))
    baselines: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 128
    batch_size: int = 8
    seed: int = 0
    target: str | None = None
    head: str = "default"
    num_threads: int | None = None
    out: str = "runs/drift"
    speed_basis: str = "wall"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError("source", f"unknown prompt source {self.source!r}", allowed=SOURCES)
        if self.source == "jsonl" and not self.jsonl_path:
            raise ConfigError("jsonl_path", "source 'jsonl' needs a file path")
        diffs = tuple(self.difficulties) if isinstance(self.difficulties, (list, tuple)) else None
        if not diffs or any(d not in (1, 2, 3, 4) for d in diffs):
            raise ConfigError("difficulties", f"must be a non-empty list of levels, got {self.difficulties!r}",
                              allowed=(1, 2, 3, 4))
        modes = tuple(self.modes) if isinstance(self.modes, (list, tuple)) else (self.modes,)
        if not modes or any(m not in MODES for m in modes):
            raise ConfigError("modes", f"bad speculative modes {self.modes!r}", allowed=MODES)
        if self.chain.mode != "chain" or self.tree.mode != "tree":
            raise ConfigError("chain" if self.chain.mode != "chain" else "tree", "its mode must match its name")
        for name in ("prompts", "max_new_tokens", "batch_size"):
            check_int(name, getattr(self, name))
        if self.speed_basis not in SPEED_BASES:
            raise ConfigError("speed_basis", f"unknown speed basis {self.speed_basis!r}", allowed=SPEED_BASES)
        if not isinstance(self.head, str) or not self.head:
            raise ConfigError("head", "must be 'default', 'random' or a head folder")
        if self.head not in ("default", "random") and not (Path(self.head) / "config.json").is_file():
            raise ConfigError("head", f"no EAGLE-3 head (config.json) at {self.head!r}; give 'default', 'random' "
                              "or a head folder")
        if self.target is not None and not Path(self.target).exists():
            raise ConfigError("target", f"no model at {self.target!r} (a Hugging Face folder or a .gguf file; "
                              "null: the embedded SmolLM2)")
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)
        object.__setattr__(self, "difficulties", diffs)
        object.__setattr__(self, "modes", tuple(dict.fromkeys(modes)))
        object.__setattr__(self, "verifiers", self._parsed_verifiers())
        self.sampling(None)  # validates temperature / top_k / top_p as ConfigErrors
        self._check_tests()

    def _parsed_verifiers(self) -> tuple[str, ...]:
        specs = self.verifiers
        if isinstance(specs, (str, dict)):
            specs = [specs]
        if not isinstance(specs, (list, tuple)) or not specs:
            raise ConfigError("verifiers", "must be a non-empty list of verifier specs")
        labels = []
        for spec in specs:
            try:
                labels.append(verifier_label(parse_verifier(spec)))
            except ConfigError as err:
                raise ConfigError(f"verifiers[{spec!r}].{err.field}", str(err).split(": ", 1)[1]) from None
            except ValueError as err:
                raise ConfigError("verifiers", str(err)) from None
        if "lossless" not in labels:
            labels.insert(0, "lossless")
        return tuple(dict.fromkeys(labels))

    def _check_tests(self) -> None:
        """Refuse here, not mid-study, a verifier test the engine refuses in a mode it runs in
        (``rollout.params.check_test``: ``test=block`` on top-k trees, ``law`` or ``block`` on
        greedy chain drafts)."""
        for mode in self.modes:
            for label in self.verifiers:
                v = parse_verifier(label)
                if not runs_in(mode, v):
                    continue
                try:
                    check_test(self.spec(mode), v, self.temperature)
                except ConfigError as err:
                    reason = str(err).split(": ", 1)[1].split(": use ")[0]  # the engine's why, without its fix
                    fix = "chain.draft_sampling: sampled" if mode == "chain" else "tree.tree_candidates: sampled"
                    raise ConfigError(f"verifiers[{label!r}].test", f"in mode {mode!r}: {reason}; set {fix} or "
                                      f"leave {mode!r} out of modes", allowed=["rule"]) from None

    def sampling(self, eos: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=() if eos is None else (eos,))

    def spec(self, mode: str) -> SpecConfig:
        return SpecConfig(mode="off") if mode == "off" else getattr(self, mode)


# ----------------------------------------------------------------------------- matched baselines
def baseline_key(v: VerifierConfig) -> str:
    """The matched baseline of verifier ``v``: ``plain`` or ``sampling[<truncation rule spec>]``."""
    return f"sampling[{verifier_label(v)}]" if v.name in TRUNCATION_RULES else PLAIN


def secondary_baseline_key(v: VerifierConfig) -> str | None:
    """The gated overshoot's min-p set as a truncation baseline (reported when it was run)."""
    gate = v.params.get("min_p") if v.name == "overshoot" else None
    return None if gate is None else f"sampling[min_p:p_base={_fmt(float(gate))}]"


@dataclass(frozen=True)
class RunSpec:
    """One configuration to run: engine arguments plus how it is compared."""

    key: str
    kind: str  # "verifier" | "baseline"
    mode: str  # "off" | "chain" | "tree"
    verifier: VerifierConfig
    baseline: str | None = None
    secondary: str | None = None


def runs_in(mode: str, v: VerifierConfig) -> bool:
    """Whether verifier ``v`` has a run in speculative ``mode``: a ``test=law`` verifier in chain
    mode only (a sampled tree always verifies towards the law: the rule's own run is that run; a
    top-k tree has no q to do it with); every other one in every mode (a test the engine refuses
    there is refused by ``DriftConfig``)."""
    return mode == "chain" or v.test != "law"


def plan_runs(cfg: DriftConfig) -> list[RunSpec]:
    """Baselines first (plain, then truncation sets), then every verifier in every mode it runs
    in (:func:`runs_in`)."""
    parsed = [parse_verifier(s) for s in cfg.verifiers]
    runs: list[RunSpec] = []
    if cfg.baselines:
        runs.append(RunSpec(PLAIN, "baseline", "off", VerifierConfig("lossless")))
        for v in parsed:
            key = baseline_key(v)
            if key != PLAIN and all(r.key != key for r in runs):
                runs.append(RunSpec(key, "baseline", "off", TruncationSamplingConfig(v.name, dict(v.params))))
    keys = {r.key for r in runs}
    for mode in cfg.modes:
        for v in (v for v in parsed if runs_in(mode, v)):
            sec = secondary_baseline_key(v)
            runs.append(RunSpec(f"{verifier_label(v)}@{mode}", "verifier", mode, v,
                                baseline_key(v) if cfg.baselines else None, sec if sec in keys else None))
    return runs
