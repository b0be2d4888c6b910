"""Checks and preparation of an EAGLE-3 head folder for vLLM's ``eagle3`` method.

What vLLM 0.32 reads from our head (``vllm/model_executor/models/llama_eagle3.py`` and the
V1 model runner), checked against our own reader (``rollout.eagle3_io``):

- ``d2t`` as offsets (target id = draft id + d2t[id]), scattered into a full-vocabulary row
  of -inf: the same convention as ours; ``t2d`` is ignored.
- ``d2t`` only where the draft vocabulary is smaller than the target's: a head drafting over
  the whole vocabulary has no ``draft_id_to_target_id`` in vLLM, which refuses to load a
  ``d2t`` then. Our writer stores one for every head (zeros: the identity, for a full
  vocabulary), so :func:`prepare_head` writes such a head's weights without it
  (:func:`vllm_head_tensors`); a full-vocabulary ``d2t`` that is not the identity is refused.
- the aux layers from ``eagle_aux_hidden_state_layer_ids`` (top level or ``eagle_config``),
  captured as the *input* of those decoder layers (``hidden + residual`` after layer i-1):
  the same features as ``hidden_states[i]`` in our engine. vLLM captures each layer once, in
  increasing order (``tuple(sorted(set(ids)))``), and concatenates them in that order; a head
  whose ids repeat a layer or are not increasing would get other features than it was trained
  on (or fewer than its ``fc`` takes): refused.
- the draft-logit temperature: vLLM reads ``logit_scale`` (default 1); we write our
  calibrated scale as ``draft_logit_scale``, which vLLM ignores. Without it vLLM's q is
  softmax(z / T) where ours is softmax(s z / T): still a valid draft (the verifier stays
  exact), but not the draft we calibrated. :func:`prepare_head` writes a folder whose config
  also carries ``logit_scale`` (the weights are linked, not copied); the backend holds it only
  while the engine is built (:func:`prepared_head`): vLLM reads the draft folder (config and
  weights) there and never after (its ``reload_weights`` would, but we push head weights
  through ``collective_rpc``, ``rollout.vllm.weights``).

:func:`check_head` refuses a head built for another target (vocabulary, hidden size, aux
layers outside the target) with a message naming the setting, and a head whose files do not
read (a config that is not JSON, a truncated or corrupt weights file) with a message naming
the file. Weights are read without running code: safetensors, or ``torch.load(...,
weights_only=True)`` for ``pytorch_model.bin`` (vLLM loads that file the same way).
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


def read_config(file: Path) -> dict:
    """A config.json as a dict; one that does not read is reported naming the file."""
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} does not read as JSON ({err})") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} holds a {type(cfg).__name__}, not a mapping")
    return cfg


def weights_file(head_path: str | Path) -> Path:
    """The head's weights file (safetensors first, as vLLM and ``rollout.eagle3_io`` pick it)."""
    path = Path(head_path)
    for f in WEIGHT_FILES:
        if (path / f).is_file():
            return path / f
    raise ConfigError("drafter_path", f"no weights in {path} (expected one of {WEIGHT_FILES})")


def read_weights(file: str | Path, names_only: bool = False) -> dict:
    """The tensors of a safetensors or ``pytorch_model.bin`` file, read without running code
    (``names_only``: the safetensors header alone, values None; a .bin is read whole). A
    truncated or corrupt file, or a pickle holding anything but tensors, is reported naming
    the file."""
    file = Path(file)
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:  # checks the header covers the file
                return {k: None if names_only else handle.get_tensor(k) for k in handle.keys()}
        import torch

        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{file} does not read as a weights file: truncated, corrupt or not tensors "
                         f"({type(err).__name__}: {err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a {type(data).__name__}, not a dict of tensors")
    return data


def _full_vocab(cfg: dict) -> bool:
    return cfg.get("draft_vocab_size", cfg.get("vocab_size")) == cfg.get("vocab_size")


def vllm_head_tensors(tensors: dict, cfg: dict, where: str | Path = "the head") -> dict:
    """The head's tensors as vLLM's ``eagle3`` model loads them: without ``d2t`` / ``t2d``
    when the draft vocabulary is the whole target vocabulary (vLLM has no mapping then),
    where ``d2t`` must be the identity (all zeros)."""
    if not _full_vocab(cfg):
        return tensors
    d2t = tensors.get("d2t")
    if d2t is not None and bool(d2t.any()):
        raise ConfigError("drafter_path", f"{where}: draft_vocab_size equals vocab_size but d2t is not the "
                          "identity; vLLM maps draft ids to target ids only for a smaller draft vocabulary")
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}


def check_head(head_path: str | Path, target_cfg: dict, aux_layer_ids: tuple[int, ...] | None = None) -> dict:
    """The head's config.json, after checking it fits the target's config.json and that its
    weights file reads (the safetensors header, or the whole .bin without running code)."""
    path = Path(head_path)
    if not (path / "config.json").is_file():
        raise ConfigError("drafter_path", f"no EAGLE-3 head at {path} (no config.json)")
    names = set(read_weights(weights_file(path), names_only=True))
    cfg = read_config(path / "config.json")
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
    if ids is not None and any(a >= b for a, b in zip(ids, ids[1:])):
        raise ConfigError("drafter_path", f"eagle_aux_hidden_state_layer_ids {ids} are not strictly increasing: "
                          f"vLLM captures the layers {sorted(set(ids))} once each, in increasing order, so the "
                          "head would get other features than it was trained on; use a head whose layers are "
                          "distinct and increasing (or the hf backend)")
    if "fc.weight" not in names:
        raise ConfigError("drafter_path", f"{weights_file(path)} has no fc.weight (not an EAGLE-3 head?)")
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


def _drops_mapping(head_path: str | Path, cfg: dict) -> bool:
    """Whether vLLM needs the head's weights without ``d2t`` / ``t2d`` (a full draft vocabulary)."""
    if not _full_vocab(cfg):
        return False
    return bool({"d2t", "t2d"} & set(read_weights(weights_file(head_path), names_only=True)))


def prepare_head(head_path: str | Path, cfg: dict, out_root: str | Path | None = None) -> str:
    """A folder vLLM can load with our calibrated draft temperature: ``head_path`` itself when
    there is nothing to change, else a new folder (the caller removes it) with the config plus
    ``logit_scale`` and links to the weights in ``head_path``, or, for a full draft vocabulary
    with a ``d2t``, the weights rewritten without ``d2t`` / ``t2d`` (:func:`vllm_head_tensors`)."""
    scale = _scale_to_carry(cfg)
    rewrite = _drops_mapping(head_path, cfg)
    if scale is None and not rewrite:
        return str(head_path)
    src = Path(head_path).resolve()
    out = Path(tempfile.mkdtemp(prefix="eagle3-vllm-", dir=out_root))
    try:
        (out / "config.json").write_text(json.dumps(cfg if scale is None else {**cfg, "logit_scale": scale},
                                                    indent=2))
        if rewrite:
            from safetensors.torch import save_file

            tensors = vllm_head_tensors(read_weights(weights_file(src)), cfg, weights_file(src))
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                      metadata={"format": "pt"})
        else:
            os.symlink(weights_file(src), out / weights_file(src).name)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return str(out)


@contextlib.contextmanager
def prepared_head(head_path: str | Path, cfg: dict):
    """:func:`prepare_head`'s folder while the block runs (an engine build), removed after; its
    links point into ``head_path``, which must outlive the block (an actor's copy of a shipped
    head is removed once the backend is built)."""
    if _scale_to_carry(cfg) is None and not _drops_mapping(head_path, cfg):
        yield str(head_path)
        return
    out = prepare_head(head_path, cfg)
    try:
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)
