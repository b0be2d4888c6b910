"""EAGLE-3 checkpoint formats: write the EAGLE/SpecForge one, read it and ``speculators``.

- **EAGLE / SpecForge** (what vLLM's ``eagle3`` method loads): ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]`` and flat Llama fields plus
  ``draft_vocab_size`` and ``target_hidden_size``; weights ``fc.weight``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets), ``t2d`` in
  ``model.safetensors`` (or ``pytorch_model.bin``).
- **speculators**: ``speculators_model_type: "eagle3"``, the layer shapes nested in
  ``transformer_layer_config``, ``eagle_aux_hidden_state_layer_ids`` at the top, weights
  named ``layers.0.*`` instead of ``midlayer.*`` (it may also store the verifier's
  embedding / lm_head, which are ignored here).

A head that does not fit the target (hidden size, vocabulary, feature layers) is refused
with a :class:`HeadMismatchError` whose message names the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rollout.eagle3_head import Eagle3Config, Eagle3Head
from rollout.models import TargetModel, default_aux_layer_ids

EAGLE_ARCH = "LlamaForCausalLMEagle3"
_IGNORED_PREFIXES = ("embed_tokens.", "verifier_", "model.embed_tokens.")


class HeadMismatchError(ValueError):
    """The checkpoint's head does not fit the target; the message names what differs."""


def save_eagle3(head: Eagle3Head, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (in the head's dtype) into folder ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.cfg
    dtype = str(head.fc.weight.dtype).removeprefix("torch.")
    config = {
        "architectures": [EAGLE_ARCH],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)},
        "draft_logit_scale": c.logit_scale,  # ours: the calibrated draft temperature (others ignore it)
    }
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def _normalise(raw: dict[str, Any], weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """Map either format onto flat EAGLE fields and ``midlayer.*`` weight names."""
    if raw.get("speculators_model_type") == "eagle3":
        fmt = "speculators"
        layer = dict(raw.get("transformer_layer_config") or {})
        fields = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
                  "target_hidden_size": raw.get("target_hidden_size"),
                  "eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids")}
        renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in weights.items()}
    else:
        fmt = "eagle"
        fields = dict(raw)
        if fields.get("eagle_aux_hidden_state_layer_ids") is None:
            fields["eagle_aux_hidden_state_layer_ids"] = (raw.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"
            )
        renamed = dict(weights)
    renamed = {k: v for k, v in renamed.items() if not k.startswith(_IGNORED_PREFIXES)}
    return fields, renamed, fmt


def check_head_fits(head, target: TargetModel) -> None:
    """Raise :class:`HeadMismatchError`, naming the field, where an in-memory head was not made
    for ``target``: the checks :func:`load_eagle3` makes of a head on disk (:func:`_check_fits`),
    each where the head's config declares the field."""
    c = head.cfg
    _check_fits(target, "", vocab=c.vocab_size, target_h=getattr(c, "target_hidden_size", target.hidden_size),
                h=getattr(c, "hidden_size", target.hidden_size),
                ids=tuple(getattr(c, "aux_layer_ids", target.aux_layer_ids)))


def _check_fits(target: TargetModel, where: str, *, vocab: int, target_h: int, h: int, ids: tuple) -> None:
    """A head's vocabulary, the target hidden size its features have (fc takes 3 x that), its own
    width (it shares the target's embeddings) and the layers it takes features from, against
    ``target``; ``where`` prefixes each message."""
    if target_h != target.hidden_size:
        raise HeadMismatchError(
            f"{where}hidden size mismatch: the head takes features of a target with hidden size {target_h} "
            f"(fc in = 3 x {target_h}), this target has hidden size {target.hidden_size}"
        )
    if h != target.hidden_size:
        raise HeadMismatchError(
            f"{where}hidden size mismatch: the head's hidden_size {h} differs from the target embedding width "
            f"{target.hidden_size} (the head shares the target's embed_tokens)"
        )
    if vocab != target.vocab_size:
        raise HeadMismatchError(f"{where}vocabulary mismatch: head vocab_size {vocab}, target vocab_size "
                                f"{target.vocab_size}")
    if len(ids) != 3 or not all(0 <= i < target.num_layers for i in ids):
        raise HeadMismatchError(f"{where}layer ids mismatch: head layer ids {ids} do not exist in a "
                                f"{target.num_layers}-layer target")
    if tuple(ids) != tuple(target.aux_layer_ids):
        raise HeadMismatchError(
            f"{where}layer ids mismatch: the head was trained on features of layers {ids}, the target captures "
            f"{target.aux_layer_ids}; load the target with aux_layer_ids={ids} (or call set_aux_layer_ids)"
        )


def _config_for(fields: dict[str, Any], weights: dict[str, torch.Tensor], target: TargetModel, where: Path) -> Eagle3Config:
    if "fc.weight" not in weights:
        raise HeadMismatchError(f"{where}: no fc.weight in the checkpoint (not an EAGLE-3 head?)")
    h = int(fields["hidden_size"])
    heads = int(fields["num_attention_heads"])
    target_h = weights["fc.weight"].shape[1] // 3
    if fields.get("target_hidden_size") not in (None, target_h):
        raise HeadMismatchError(f"{where}: target_hidden_size {fields['target_hidden_size']} disagrees with fc.weight")
    vocab = int(fields["vocab_size"])
    ids = fields.get("eagle_aux_hidden_state_layer_ids")
    ids = default_aux_layer_ids(target.num_layers) if ids is None else tuple(int(i) for i in ids)
    _check_fits(target, f"{where}: ", vocab=vocab, target_h=target_h, h=h, ids=ids)
    return Eagle3Config(
        hidden_size=h,
        intermediate_size=int(fields["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(fields.get("num_key_value_heads") or heads),
        head_dim=int(fields.get("head_dim") or h // heads),
        rms_norm_eps=float(fields.get("rms_norm_eps") or 1e-5),
        rope_theta=float(fields.get("rope_theta") or 10000.0),
        vocab_size=vocab,
        draft_vocab_size=int(fields.get("draft_vocab_size") or vocab),
        target_hidden_size=target_h,
        aux_layer_ids=ids,
        max_position_embeddings=int(fields.get("max_position_embeddings") or 8192),
        logit_scale=float(fields.get("draft_logit_scale") or 1.0),
    )


def read_eagle3_config(path: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of a head folder (to pick the target's aux layers before loading)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    return json.loads((path / "config.json").read_text())


def load_eagle3(path: str | Path, target: TargetModel, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load either format into an :class:`Eagle3Head` on the target's device, in ``dtype``."""
    path = Path(path)
    raw = read_eagle3_config(path)
    fields, weights, fmt = _normalise(raw, _read_weights(path))
    cfg = _config_for(fields, weights, target, path)
    head = Eagle3Head(cfg, target.embed_tokens)
    if "d2t" not in weights:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise HeadMismatchError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size but no d2t mapping")
        weights["d2t"], weights["t2d"] = head.d2t.clone(), head.t2d.clone()
    if "t2d" not in weights:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + weights["d2t"].long()] = True
        weights["t2d"] = t2d
    weights["d2t"], weights["t2d"] = weights["d2t"].long(), weights["t2d"].bool()
    ids = torch.arange(cfg.draft_vocab_size) + weights["d2t"]
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise HeadMismatchError(f"{path}: vocabulary mismatch: d2t maps draft ids outside the target vocabulary")
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise HeadMismatchError(f"{path} ({fmt} format): missing weights {missing}, unexpected weights {unexpected}")
    return head.to(device=target.device, dtype=dtype).eval()
