"""Checks and preparation of an EAGLE-3 head folder for vLLM's ``eagle3`` method.

What vLLM 0.32 reads from our head (``vllm/model_executor/models/llama_eagle3.py`` and the
V1 model runner), checked against our own reader (``rollout.eagle3_io``):

- ``d2t`` as offsets (target id = draft id + d2t[id]), scattered into a full-vocabulary row
  of -inf: the same convention as ours; ``t2d`` is ignored.
- the aux layers from ``eagle_aux_hidden_state_layer_ids`` (top level or ``eagle_config``),
  captured as the *input* of those decoder layers (``hidden + residual`` after layer i-1):
  the same features as ``hidden_states[i]`` in our engine.
- the draft-logit temperature: vLLM reads ``logit_scale`` (default 1); we write our
  calibrated scale as ``draft_logit_scale``, which vLLM ignores. Without it vLLM's q is
  softmax(z / T) where ours is softmax(s z / T): still a valid draft (the verifier stays
  exact), but not the draft we calibrated. :func:`prepare_head` writes a folder whose config
  also carries ``logit_scale`` (the weights are linked, not copied); the backend holds it only
  while the engine is built (:func:`prepared_head`): vLLM reads the draft folder (config and
  weights) there and never after (its ``reload_weights`` would, but we push head weights
  through ``collective_rpc``, ``rollout.vllm.weights``).

:func:`check_head` refuses a head built for another target (vocabulary, hidden size, aux
layers outside the target) with a message naming the setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from rollout.config import ConfigError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _aux_ids(cfg: dict) -> list[int] | None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def check_head(head_path: str | Path, target_cfg: dict, aux_layer_ids: tuple[int, ...] | None = None) -> dict:
    """The head's config.json, after checking it fits the target's config.json."""
    path = Path(head_path)
    if not (path / "config.json").is_file():
        raise ConfigError("drafter_path", f"no EAGLE-3 head at {path} (no config.json)")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ConfigError("drafter_path", f"no weights in {path} (expected one of {WEIGHT_FILES})")
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("speculators_model_type") is not None:
        raise ConfigError("drafter_path", f"{path} is in the speculators format; vLLM's eagle3 method is "
                          "given the EAGLE format here (convert it with rollout.eagle3_io)")
    vocab, t_vocab = cfg.get("vocab_size"), target_cfg.get("vocab_size")
    if vocab != t_vocab:
        raise ConfigError("drafter_path", f"head for another target: vocab_size {vocab} != the target's {t_vocab}")
    th = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if th != target_cfg.get("hidden_size"):
        raise ConfigError("drafter_path", f"head for another target: target_hidden_size {th} != the target's "
                          f"hidden_size {target_cfg.get('hidden_size')}")
    n = int(target_cfg.get("num_hidden_layers", 0))
    ids = _aux_ids(cfg)
    if ids is not None and not all(0 <= i < n for i in ids):
        raise ConfigError("drafter_path", f"head for another target: eagle_aux_hidden_state_layer_ids {ids} "
                          f"do not exist in a {n}-layer target")
    if aux_layer_ids is not None:
        want = list(ids) if ids is not None else [2, n // 2, n - 3]
        if list(aux_layer_ids) != want:
            raise ConfigError("aux_layer_ids", f"target.aux_layer_ids {list(aux_layer_ids)} differ from the "
                              f"head's layers {want}; vLLM takes the aux layers from the head")
    return cfg


def _scale_to_carry(cfg: dict) -> float | None:
    """Our ``draft_logit_scale`` where vLLM would not read it (no ``logit_scale`` equal to it)."""
    scale = cfg.get("draft_logit_scale")
    return None if scale in (None, 1, 1.0) or cfg.get("logit_scale") == scale else float(scale)


def prepare_head(head_path: str | Path, cfg: dict, out_root: str | Path | None = None) -> str:
    """A folder vLLM can load with our calibrated draft temperature: ``head_path`` itself when
    there is no ``draft_logit_scale`` to carry over, else a new folder (the caller removes it)
    with the config plus ``logit_scale`` and links to the weights in ``head_path``."""
    scale = _scale_to_carry(cfg)
    if scale is None:
        return str(head_path)
    src = Path(head_path).resolve()
    out = Path(tempfile.mkdtemp(prefix="eagle3-vllm-", dir=out_root))
    try:
        (out / "config.json").write_text(json.dumps({**cfg, "logit_scale": scale}, indent=2))
        for f in WEIGHT_FILES:
            if (src / f).is_file():
                os.symlink(src / f, out / f)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return str(out)


@contextlib.contextmanager
def prepared_head(head_path: str | Path, cfg: dict):
    """:func:`prepare_head`'s folder while the block runs (an engine build), removed after; its
    links point into ``head_path``, which must outlive the block (an actor's copy of a shipped
    head is removed once the backend is built)."""
    if _scale_to_carry(cfg) is None:
        yield str(head_path)
        return
    out = prepare_head(head_path, cfg)
    try:
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)
