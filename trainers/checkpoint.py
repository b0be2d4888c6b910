"""Checkpoints of a training run: policy, optimizer, drafter reference, step and RNG state.

Layout: ``<out_dir>/checkpoints/step_000004/`` with ``policy.safetensors`` (fp32),
``optimizer.pt``, ``state.json`` (step, policy version, seed, drafter path, RNG states of
``random`` and torch) and, when a drafter is used, a copy of the head folder in
``drafter/``. A checkpoint is written to a temporary folder and renamed, so a crash
never leaves a half-written one behind. Every randomness of the loop is derived from
(seed, step), so restoring these gives the same next step as an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    root = Path(out_dir) / "checkpoints"
    found = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file()) if root.is_dir() else []
    return found[-1] if found else None


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, drafter_path: Path | None = None) -> Path:
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
    full_state = dict(state, step=step, aliases=aliases, python_rng=_encode_py_rng(random.getstate()),
                      torch_rng=torch.get_rng_state().tolist())
    if drafter_path is not None:
        shutil.copytree(drafter_path, tmp / "drafter")
        full_state["drafter"] = "drafter"
    (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    state = json.loads((path / "state.json").read_text())
    weights = load_file(str(path / "policy.safetensors"))
    for name, target in state.get("aliases", {}).items():
        weights[name] = weights[target]
    model.load_state_dict(weights)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    random.setstate(_decode_py_rng(state["python_rng"]))
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    return state


def _encode_py_rng(s):
    return [s[0], list(s[1]), s[2]]


def _decode_py_rng(s):
    return (s[0], tuple(s[1]), s[2])
