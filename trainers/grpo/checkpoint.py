"""Checkpoints of a training run: policy, optimizer, drafter reference, step and RNG state.

Layout: ``<out_dir>/checkpoints/step_000004/`` with ``policy.safetensors`` (fp32),
``optimizer.pt``, ``state.json`` (step, policy version, seed, drafter path, RNG states of
``random`` and torch), when a drafter is used, a copy of the head folder in ``drafter/``,
and, when the head trains with the policy, its fp32 weights, optimizer and sample window in
``drafter_training.pt`` (``trainers.grpo.online_drafter``). A checkpoint is written to
``step_N.tmp`` and renamed, ``state.json`` last and atomically, so a kill never leaves a
half-written one where ``latest_checkpoint`` looks (it ignores ``.tmp`` folders and unreadable
states). Every randomness of the loop is derived from (seed, step), so restoring these gives
the same next step as an uninterrupted run.

Loading runs no code from the files: weights are safetensors, ``.pt`` files are read with
``torch.load(weights_only=True)`` (tensors and plain containers only) through :func:`load_state`,
and the RNG states are JSON. A truncated, corrupt or refused file raises :class:`CheckpointError`
naming it and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rollout.config import _rebuild_error
from trainers.grpo.guards import NonFiniteError

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)")
RESUME_ADVICE = "resume from an earlier checkpoint (move this one's folder aside) or start over with --fresh"


class CheckpointError(RuntimeError):
    """A saved file (weights, optimizer or head state, state.json) that cannot be read safely:
    missing, truncated, corrupt, or holding objects other than tensors and plain containers."""

    def __init__(self, path: str | Path, reason: str, advice: str = RESUME_ADVICE):
        self.path = str(path)
        super().__init__(f"{path}: {reason}; {advice}")

    def __reduce__(self):  # crosses a pickle whole (the default would call __init__ with the message alone)
        return _rebuild_error, (type(self), self.args, self.__dict__)


# the general paragraphs of torch's refusal (its advice to load with weights_only=False is not ours)
_TORCH_BOILERPLATE = re.compile(r"Weights only load failed|Please file an issue|Check the documentation|\(\d\) ")


def _why(err: BaseException) -> str:
    """A short reason from a loader's exception: its first specific sentence (for torch's
    refusal, the global or opcode it refused)."""
    text = str(err)
    m = re.search(r"WeightsUnpickler error:[ \t]*(\S[^\n]*)", text)
    lines = [m.group(1)] if m else [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not _TORCH_BOILERPLATE.match(ln)]
    reason = lines[0].split(". ")[0].rstrip(".")[:200] if lines else ""
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def load_state(path: str | Path, required: tuple[str, ...] = (), advice: str = RESUME_ADVICE,
               map_location=None) -> dict:
    """The dict saved with ``torch.save`` at ``path``, read with ``weights_only=True`` (tensors,
    numbers, strings and containers of them; no object's code runs), holding the ``required``
    keys. Any failure raises :class:`CheckpointError` naming the file and ``advice``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "is missing", advice)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's refusal of a global, or a damaged pickle stream
        raise CheckpointError(path, "is not a file of tensors and plain containers (truncated, corrupt, or "
                              f"holding other objects, which are refused: loading them could run code; {_why(err)})",
                              advice) from None
    except Exception as err:  # a torn zip archive, an empty file, foreign bytes
        raise CheckpointError(path, f"is truncated or corrupt ({_why(err)})", advice) from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not the saved mapping", advice)
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(path, f"lacks {', '.join(map(repr, missing))} (not this kind of state file)", advice)
    return state


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The highest complete ``step_NNNNNN`` folder; ``step_N.tmp`` folders (a save cut short)
    and folders whose ``state.json`` does not parse are skipped, the latter with a warning."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())
    for _, path in reversed(steps):
        if read_state(path) is not None:
            return path
        log.warning("skipping checkpoint %s: its state.json is missing or unreadable", path)
    return None


def read_state(path: Path) -> dict | None:
    """A checkpoint's state.json, or None when it is missing or not a complete JSON object."""
    try:
        state = json.loads((Path(path) / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and "step" in state else None


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary file, fsync and rename: a kill
    leaves either the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, drafter_path: Path | None = None, extra: dict[str, object] | None = None) -> Path:
    """Write the checkpoint of ``step`` (see the module doc); ``extra``: objects saved beside
    the policy as ``<name>.pt`` (``torch.save``), e.g. the online drafter's state."""
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # tied weights share storage: save each tensor once, remember the aliases
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    unique: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        key = t.data_ptr()
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t
    save_file(unique, str(tmp / "policy.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    for name, obj in (extra or {}).items():
        torch.save(obj, tmp / f"{name}.pt")
    full_state = dict(state, step=step, aliases=aliases, python_rng=_encode_py_rng(random.getstate()),
                      torch_rng=torch.get_rng_state().tolist())
    if drafter_path is not None:
        shutil.copytree(drafter_path, tmp / "drafter")
        full_state["drafter"] = "drafter"
    write_atomic(tmp / "state.json", json.dumps(full_state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def read_policy(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A checkpoint folder's policy weights (every name, tied ones included) and its state;
    a missing or damaged file raises :class:`CheckpointError` naming it."""
    path = Path(path)
    state = read_state(path)
    if state is None:
        raise CheckpointError(path / "state.json", "is missing, truncated or not a checkpoint state")
    st = path / "policy.safetensors"
    try:
        weights = load_file(str(st))
    except Exception as err:  # safetensors' own error for a torn file: a header that does not cover it
        raise CheckpointError(st, f"is missing, truncated or corrupt ({_why(err)})") from None
    for name, target in state.get("aliases", {}).items():
        weights[name] = weights[target]
    for name, t in weights.items():  # a damaged or foreign checkpoint may hold NaNs
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise NonFiniteError(state["step"], f"checkpoint {path.name}", f"{name} holds NaN or inf; resume "
                                 "from an earlier checkpoint (move this one aside) or start over with --fresh")
    return weights, state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, what: str) -> list[str]:
    """``optimizer.load_state_dict(state)`` keeping the optimizer's own settings (lr, betas,
    weight_decay, ...: what the config built it with), not the saved ones, which torch's load
    would restore; so a resume with a changed setting (a lower lr after a divergence) uses it.
    Returns the changed settings as "name saved -> now", logged as a warning naming ``what``."""
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    changed = []
    for group, settings in zip(optimizer.param_groups, mine):
        for k, v in settings.items():
            if group.get(k) != v:
                changed.append(f"{what}.{k} {group.get(k)!r} -> {v!r}")
            group[k] = v
    if changed:
        log.warning("resumed with changed optimizer settings (the config's apply): %s", "; ".join(sorted(set(changed))))
    return changed


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    path = Path(path)
    weights, state = read_policy(path)
    model.load_state_dict(weights)
    opt_path = path / "optimizer.pt"
    opt_state = load_state(opt_path, required=("state", "param_groups"))
    try:
        load_optimizer_state(optimizer, opt_state, "optim")
    except (ValueError, KeyError, TypeError) as err:  # groups or parameters that do not match this model
        raise CheckpointError(opt_path, f"does not fit this optimizer ({_why(err)})") from None
    try:
        random.setstate(_decode_py_rng(state["python_rng"]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(path / "state.json", f"holds no valid RNG state ({_why(err)})") from None
    return state


def _encode_py_rng(s):
    return [s[0], list(s[1]), s[2]]


def _decode_py_rng(s):
    return (s[0], tuple(s[1]), s[2])
