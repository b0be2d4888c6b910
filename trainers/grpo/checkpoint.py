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

Disk space: before a save, the checkpoint's size is estimated (the bytes of the policy's tensors,
the optimizer state, the ``extra`` objects' tensors and the head folder) and compared with the
free space of the volume (``shutil.disk_usage``); a shortfall raises :class:`DiskFullError` before
anything is written. A save that fails anyway (ENOSPC from a write, safetensors' or torch's writer
error, the rename) removes its ``.tmp`` folder and raises :class:`DiskFullError` (out of space) or
:class:`CheckpointWriteError` (another write error), naming the folder and the last good
checkpoint: the earlier checkpoints and the logs are untouched, and a rerun resumes from them.
Retention (``keep``, ``run.keep_checkpoints``): once a checkpoint is complete (renamed from
``.tmp``), the complete checkpoints older than the newest ``keep`` are removed, and so are
``.tmp`` folders of earlier saves cut short (one writer per run folder: ``run_lock``).

Loading runs no code from the files: weights are safetensors, ``.pt`` files are read with
``torch.load(weights_only=True)`` (tensors and plain containers only) through :func:`load_state`,
and the RNG states are JSON. A truncated, corrupt or refused file raises :class:`CheckpointError`
naming it and what to do.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
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


class CheckpointWriteError(RuntimeError):
    """A checkpoint or state file that could not be written; its partial copy was removed and the
    message names the folder and the last good checkpoint."""

    def __init__(self, folder: str | Path, message: str, last_good: str | Path | None = None):
        self.folder = str(folder)
        self.last_good = None if last_good is None else str(last_good)
        super().__init__(message)

    def __reduce__(self):  # crosses a pickle whole
        return _rebuild_error, (type(self), self.args, self.__dict__)


class DiskFullError(CheckpointWriteError):
    """Not enough free disk space for a checkpoint (found before writing, or by a write that failed
    with ENOSPC): names the folder, the bytes needed and free, and the last good checkpoint."""

    def __init__(self, folder: str | Path, what: str, needed: int, free: int, advice: str,
                 last_good: str | Path | None = None, during: str | None = None):
        self.needed, self.free = int(needed), int(free)
        if during is None:
            head = f"not enough disk space for {what} in {folder}: it needs about {_size(needed)}, {_size(free)} free"
        else:  # the free space once the partial copy is gone (another writer may have taken the rest)
            head = (f"writing {what} in {folder} ran out of disk space ({during}): it needs about {_size(needed)}, "
                    f"{_size(free)} free after removing the partial copy")
        super().__init__(folder, f"{head}; {advice}", last_good)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


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
    leaves either the old file or the new one, never a torn one. A failed write removes the
    temporary file; out of disk space it raises :class:`DiskFullError` (the old file stays)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and out_of_space(err):
            needed = len(text.encode() if isinstance(text, str) else text)
            raise DiskFullError(path.parent, path.name, needed, _free(path.parent),
                                f"{path.name} keeps its previous version (if any); make space and run again",
                                during=_why(err)) from None
        raise


# torch's zip writer reports a failed write (ENOSPC among others) as a RuntimeError without an errno
_TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|file write failed")
_NO_SPACE = re.compile(r"No space left on device|os error 28\b|Disk quota exceeded|os error 122\b")


def out_of_space(err: BaseException) -> bool:
    """Whether ``err`` says the volume is full (ENOSPC, or EDQUOT: the user's quota)."""
    return isinstance(err, DiskFullError) or getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or bool(
        _NO_SPACE.search(str(err)))


def is_write_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from writing a file: an OSError, safetensors' error, torch's writer's,
    or :func:`write_atomic`'s."""
    return isinstance(err, (OSError, CheckpointWriteError)) or type(err).__name__ == "SafetensorError" or (
        isinstance(err, RuntimeError) and bool(_TORCH_WRITE_FAILED.search(str(err))))


def _free(folder: Path) -> int:
    """Free bytes (for this user) on the volume of ``folder`` or its nearest existing parent."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or dicts / lists / tuples of them), each storage
    counted once (tied weights share one)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _folder_bytes(path: Path | None) -> int:
    if path is None:
        return 0
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def with_margin(payload: int) -> int:
    """A save's estimated bytes: its tensors' and files' ``payload`` plus 1% and 1 MiB (file headers,
    alignment, small state files)."""
    return payload + payload // 100 + (1 << 20)


def require_space(folder: Path, needed: int, what: str, advice: Callable[[], tuple[str, Path | None]]) -> None:
    """Raise :class:`DiskFullError` before writing ``what`` (``needed`` bytes) into ``folder`` when
    its volume has less free; ``advice()``: what is left to resume from, said, and that checkpoint."""
    free = _free(folder)
    if needed > free:
        text, last = advice()
        raise DiskFullError(folder, what, needed, free, text, last)


def failed_write(err: BaseException, partial: Path, folder: Path, what: str, needed: int,
                 advice: Callable[[], tuple[str, Path | None]], remove: bool = True) -> CheckpointWriteError | None:
    """After ``err`` stopped the write of ``what`` into ``folder``: remove the ``partial`` folder
    (unless ``remove`` is false: it existed before this write) and return the error to raise
    instead (:class:`DiskFullError` when out of space, else :class:`CheckpointWriteError`), or None
    when ``err`` is no write failure (re-raise it)."""
    # out of space: said so (ENOSPC, EDQUOT), or torch's writer failed where the rest no longer fits
    full = out_of_space(err) or (isinstance(err, RuntimeError) and bool(_TORCH_WRITE_FAILED.search(str(err)))
                                 and _free(folder) < needed - _folder_bytes(partial if partial.is_dir() else None))
    if remove:
        shutil.rmtree(partial, ignore_errors=True)
    if not isinstance(err, Exception) or not is_write_failure(err):
        return None
    text, last = advice()
    text = (f"removed the partial {partial.name}" if remove else f"{partial.name} existed before this write and "
            "is left as it is") + f"; {text}"
    if full:
        return DiskFullError(folder, what, needed, _free(folder), text, last, during=_why(err))
    return CheckpointWriteError(folder, f"writing {what} in {folder} failed ({_why(err)}); {text}", last)


def _resume_advice(out_dir: str | Path) -> tuple[str, Path | None]:
    """What a failed save leaves to resume from, said, and that checkpoint."""
    last = latest_checkpoint(out_dir)
    if last is None:
        return "there is no complete checkpoint yet (a rerun starts at step 0); the logs are intact", None
    return (f"the last good checkpoint is {last}; it, the earlier ones and the logs are intact: make space and "
            "rerun the same command to resume from it"), last


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, drafter_path: Path | None = None, extra: dict[str, object] | None = None,
                    keep: int | None = None) -> Path:
    """Write the checkpoint of ``step`` (see the module doc); ``extra``: objects saved beside
    the policy as ``<name>.pt`` (``torch.save``), e.g. the online drafter's state; ``keep``: the
    complete checkpoints to keep, this one included (None: all). Raises :class:`DiskFullError`
    (before writing, or when a write runs out of space) or :class:`CheckpointWriteError`, the
    partial checkpoint removed."""
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    root = final.parent
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
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
    opt_state = optimizer.state_dict()
    # the estimate: the bytes of every tensor saved and of the head's files, with a margin
    needed = with_margin(tensor_bytes(unique) + tensor_bytes(opt_state) + tensor_bytes(extra or {})
                         + _folder_bytes(drafter_path))
    what, advice = f"checkpoint {final.name}", lambda: _resume_advice(out_dir)
    require_space(root, needed, what, advice)
    try:
        tmp.mkdir(parents=True)
        save_file(unique, str(tmp / "policy.safetensors"))
        torch.save(opt_state, tmp / "optimizer.pt")
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
    except BaseException as err:  # nothing partial stays (a kill -9 leaves the .tmp, which no resume reads)
        said = failed_write(err, tmp, root, what, needed, advice)
        if said is None:
            raise
        raise said from None
    if keep is not None:
        prune_checkpoints(out_dir, keep, step)
    return final


def prune_checkpoints(out_dir: str | Path, keep: int, upto: int) -> list[Path]:
    """Remove the complete checkpoints of steps <= ``upto`` older than the newest ``keep`` of
    them, and ``.tmp`` folders of steps < ``upto`` (earlier saves cut short); a folder whose
    state.json does not read, or of a later step, is left alone. Returns what was removed (a
    removal that fails is logged and skipped: retention never stops a run)."""
    root = Path(out_dir) / "checkpoints"
    complete, partial = [], []
    for p in root.iterdir():
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir() and int(m.group(1)) <= upto and read_state(p) is not None:
            complete.append((int(m.group(1)), p))
        elif (m := _STEP_DIR.fullmatch(p.name.removesuffix(".tmp"))) and p.name.endswith(".tmp") \
                and int(m.group(1)) < upto:
            partial.append((int(m.group(1)), p))
    doomed = [p for _, p in sorted(complete)[:-keep]] + [p for _, p in sorted(partial)]
    removed = []
    for p in doomed:
        try:
            shutil.rmtree(p)
            removed.append(p)
        except OSError as err:
            log.warning("could not remove the old checkpoint %s (%s)", p, err)
    return removed


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
