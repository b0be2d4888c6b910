"""What belongs to a run folder: its config snapshot, and which checkpoints a run may resume.

- **snapshot**: ``<out_dir>/config.json``, the validated config of the run that wrote the
  folder's checkpoints (written when a run starts from step 0, kept on resume).
- **resume check**: a resume whose seed, model, sampling, verifier (or its truncation baseline),
  task, GRPO, correction or reward settings differ from the snapshot is refused with the list of differences
  (``run.allow_config_change`` / ``--allow-config-change`` accepts them and rewrites the
  snapshot), and so is one that changes the law the rollouts come from otherwise: the rollout
  copy's rounding (``backend_options.weights``) and, for a lossy verifier, what it verifies
  (``spec.mode``, ``draft_sampling``, ``tree_candidates``). Both sides are compared as
  validated configs (defaults filled, a rule's parameters in full), so a field added by a
  newer version or a rule's default written out is no difference. Steps, out_dir, the
  optimizer, the speculation shape otherwise and the actor layout may change freely: they do
  not change what the checkpoints mean.
- **fencing**: a run that does not resume (``run.resume: false``, ``--fresh``) moves the
  previous run's outputs (``checkpoints/``, the snapshot, ``metrics.jsonl``, ``rollouts.jsonl``,
  ``tb/``, ``summary.md``, ``plots/``, a study's ``eval.jsonl``) to ``superseded/<UTC time>/`` and says so: a later resume
  cannot pick up the old run's higher step, nothing of the old run is overwritten, and
  TensorBoard does not show the two runs' events as one.

``resume_point`` only reads (the CLI calls it before Ray starts); ``prepare_run_dir`` is
the trainer's start-up and does the writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from rollout.config import ConfigError
from trainers.grpo.checkpoint import latest_checkpoint, write_atomic

log = logging.getLogger(__name__)

SNAPSHOT = "config.json"
COMPARED = ("run.seed", "model", "rollout.sampling", "rollout.verifier", "rollout.truncation_sampling", "task",
            "grpo", "correction", "reward")


def config_dict(cfg) -> dict:
    """The config as plain JSON data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested config dict as ``{"a.b.c": value}`` (an empty section stays one ``{}`` value)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# what a lossy verifier's law depends on beyond its own settings (lossless: P = p whatever they are)
LAW_OF_LOSSY = ("rollout.spec.mode", "rollout.spec.draft_sampling", "rollout.spec.tree_candidates")
LAW_OF_ALL = ("rollout.backend_options.weights",)  # the rollout copy itself (exact or rounded)


def comparable(data: dict) -> dict:
    """A config dict as the resume check compares it: validated (a snapshot written by an older
    version gets the fields added since, at their defaults) and the verifier's parameters in full
    (``{}`` and the rule's defaults written out are the same rule); as it is if it no longer
    validates (a field since removed, a model path since moved)."""
    import warnings

    from rollout.config import from_dict
    from trainers.grpo.config import TrainConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = from_dict(TrainConfig, data)
        out = config_dict(cfg)
        out["rollout"]["verifier"]["params"] = config_dict(cfg.rollout.verifier.rule())
        if cfg.rollout.backend == "hf":
            out["rollout"]["backend_options"].setdefault("weights", "exact")
    except Exception:  # noqa: BLE001 - compared raw, as before
        return data
    return out


def _lossy(data: dict) -> bool:
    rollout = data.get("rollout")
    verifier = rollout.get("verifier") if isinstance(rollout, dict) else None
    return isinstance(verifier, dict) and verifier.get("name", "lossless") != "lossless"


def config_differences(old: dict, new: dict) -> list[str]:
    """``field: old -> new`` for every compared field that differs (:func:`comparable` forms of both)."""
    old, new = comparable(old), comparable(new)
    a, b = flatten(old), flatten(new)
    compared = COMPARED + LAW_OF_ALL
    if any(_lossy(d) for d in (old, new)):
        compared += LAW_OF_LOSSY
    keys = sorted(k for k in set(a) | set(b) if any(k == c or k.startswith(c + ".") for c in compared))
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys if a.get(k) != b.get(k)]


def read_snapshot(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / SNAPSHOT
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resume_point(cfg) -> Path | None:
    """The checkpoint this run resumes from (None: starts at step 0). Reads only; raises
    ConfigError when the folder's snapshot differs in a compared field and the change is
    not allowed."""
    if not cfg.run.resume:
        return None
    ckpt = latest_checkpoint(cfg.run.out_dir)
    if ckpt is None:
        return None
    snap = read_snapshot(cfg.run.out_dir)
    if snap is None:
        log.warning("%s has checkpoints but no %s snapshot: resuming unchecked", cfg.run.out_dir, SNAPSHOT)
        return ckpt
    diffs = config_differences(snap, config_dict(cfg))
    if diffs and not cfg.run.allow_config_change:
        raise ConfigError("run.resume", f"{ckpt} belongs to a run with a different config: " + "; ".join(diffs)
                          + " (start over with --fresh, use another run.out_dir, or pass --allow-config-change)")
    return ckpt


# what a run writes in its folder (checkpoints, snapshot, logs, TensorBoard events, summary, figures,
# and the held-out evaluations of a study run, trainers.study.evaluate)
RUN_OUTPUTS = ("checkpoints", SNAPSHOT, "metrics.jsonl", "rollouts.jsonl", "tb", "summary.md", "plots", "eval.jsonl")


def fence_previous_run(out_dir: str | Path, why: str = "--fresh", extra: tuple[Path, ...] = ()) -> Path | None:
    """Move an earlier run's outputs (:data:`RUN_OUTPUTS`, and ``extra`` paths in ``out_dir``)
    aside, whole, saying so after ``why``; returns where, or None if none."""
    out = Path(out_dir)
    moved = [out / name for name in RUN_OUTPUTS if (out / name).exists()] + [Path(p) for p in extra]
    if not moved:
        return None
    dest = out / "superseded" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for p in moved:
        p.rename(dest / p.name)
    print(f"{why}: moved the previous run's {', '.join(p.name for p in moved)} to {dest}", flush=True)
    return dest


def prepare_run_dir(cfg) -> Path | None:
    """Start-up of a run folder: fence (fresh run), check (resume), write the snapshot.
    Returns the checkpoint to resume from, or None."""
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.run.resume:
        fence_previous_run(out)
    ckpt = resume_point(cfg)
    if ckpt is None:  # nothing to resume (checkpoints deleted or unreadable): step 0 must not erase old logs
        fence_previous_run(out, "no checkpoint to resume from")
    if ckpt is None or cfg.run.allow_config_change or read_snapshot(out) is None:
        write_atomic(out / SNAPSHOT, json.dumps(config_dict(cfg), indent=1, sort_keys=True) + "\n")
    return ckpt
