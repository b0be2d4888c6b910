"""EAGLE-3 checkpoint formats: write the EAGLE/SpecForge one, read it and ``speculators``.

- **EAGLE / SpecForge** (what vLLM's ``eagle3`` method loads): ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]`` and flat Llama fields plus
  ``draft_vocab_size`` and ``target_hidden_size``; weights ``fc.weight``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (offsets), ``t2d`` in
  ``model.safetensors`` (or ``pytorch_model.bin``).
- **speculators** (vllm-project/speculators): ``speculators_model_type: "eagle3"``, the
  layer shapes nested in ``transformer_layer_config`` (a Llama or Qwen3 layer config),
  ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` and
  ``eagle_aux_hidden_state_layer_ids`` at the top, weights named ``layers.0.*`` instead of
  ``midlayer.*`` (it may also store the verifier's embedding, ``embed_tokens.weight``: it
  must have the target's shape, and the target's own is used).

Both formats map draft ids to target ids the same way: ``d2t[i]`` is an offset (target id
= ``i + d2t[i]``), ``t2d`` a bool mask over the target vocabulary; a head without them drafts
over the whole target vocabulary. Layer variants (``rollout.eagle3_head``): ``attention_bias``
(config field, or ``q_proj.bias`` in the weights), ``qk_norm`` (``q_norm``/``k_norm`` weights),
``norm_before_residual`` (config field; absent means false in the EAGLE format and true in the
speculators format, as vLLM reads them), ``rope_scaling`` ("linear", "llama3").

A head that does not fit the target (hidden size, vocabulary, feature layers) or that this
reader cannot run (another activation, RoPE scaling, weight shapes) is refused with a
:class:`HeadMismatchError` whose message names the file and what differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rollout.config import ConfigError
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
        "norm_before_residual": c.norm_before_residual,
    }
    if c.rope_scaling:
        config["rope_scaling"] = dict(c.rope_scaling)
    if c.attention_bias:
        config["attention_bias"] = True
    if c.qk_norm:
        config["qk_norm"] = True  # ours: read from the weights' q_norm / k_norm
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
    """Map either format onto flat EAGLE fields and ``midlayer.*`` weight names (the verifier's
    embedding, where stored, stays under ``embed_tokens.weight``)."""
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    if raw.get("speculators_model_type") == "eagle3":
        fmt = "speculators"
        layer = dict(raw.get("transformer_layer_config") or {})
        fields = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
                  "target_hidden_size": raw.get("target_hidden_size"),
                  "eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids"),
                  "norm_before_residual": raw.get("norm_before_residual", True)}
        renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in weights.items()}
    else:
        fmt = "eagle"
        fields = dict(raw)
        if fields.get("eagle_aux_hidden_state_layer_ids") is None:
            fields["eagle_aux_hidden_state_layer_ids"] = (raw.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"
            )
        renamed = dict(weights)
    renamed = {k: v for k, v in renamed.items() if not k.startswith(_IGNORED_PREFIXES) or k == "embed_tokens.weight"}
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


def _rope_fields(fields: dict[str, Any]) -> tuple[float, dict | None]:
    """RoPE base and scaling from flat config fields (``rope_theta`` / ``rope_scaling``, or a
    transformers-5 ``rope_parameters`` holding both)."""
    params = fields.get("rope_parameters") or {}
    theta = float(fields.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = fields.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def _config_for(fields: dict[str, Any], weights: dict[str, torch.Tensor], target: TargetModel, where: Path) -> Eagle3Config:
    if "fc.weight" not in weights:
        raise HeadMismatchError(f"{where}: no fc.weight in the checkpoint (not an EAGLE-3 head?)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if fields.get(k) is None]
    if missing:
        raise HeadMismatchError(f"{where}: config.json has no {', '.join(missing)}")
    act = fields.get("hidden_act") or "silu"
    if act != "silu":
        raise HeadMismatchError(f"{where}: hidden_act {act!r} is not supported (allowed: silu)")
    if fields.get("mlp_bias"):
        raise HeadMismatchError(f"{where}: mlp_bias true is not supported (the head's MLP has no biases)")
    h = int(fields["hidden_size"])
    heads = int(fields["num_attention_heads"])
    target_h = weights["fc.weight"].shape[1] // 3
    if fields.get("target_hidden_size") not in (None, target_h):
        raise HeadMismatchError(f"{where}: target_hidden_size {fields['target_hidden_size']} disagrees with fc.weight")
    vocab = int(fields["vocab_size"])
    ids = fields.get("eagle_aux_hidden_state_layer_ids")
    ids = default_aux_layer_ids(target.num_layers) if ids is None else tuple(int(i) for i in ids)
    _check_fits(target, f"{where}: ", vocab=vocab, target_h=target_h, h=h, ids=ids)
    embed = weights.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != tuple(target.embed_tokens.weight.shape):
        raise HeadMismatchError(f"{where}: embed_tokens.weight is {tuple(embed.shape)}, the target's embedding is "
                                f"{tuple(target.embed_tokens.weight.shape)} (vocabulary or hidden size mismatch)")
    lm_head = weights.get("lm_head.weight")
    draft_vocab = int(fields.get("draft_vocab_size") or (len(lm_head) if lm_head is not None else vocab))
    theta, scaling = _rope_fields(fields)
    try:
        return Eagle3Config(
            hidden_size=h,
            intermediate_size=int(fields["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(fields.get("num_key_value_heads") or heads),
            head_dim=int(fields.get("head_dim") or h // heads),
            rms_norm_eps=float(fields.get("rms_norm_eps") or 1e-5),
            rope_theta=theta,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=target_h,
            aux_layer_ids=ids,
            max_position_embeddings=int(fields.get("max_position_embeddings") or 8192),
            logit_scale=float(fields.get("draft_logit_scale") or 1.0),
            rope_scaling=scaling,
            attention_bias=bool(fields.get("attention_bias")) or "midlayer.self_attn.q_proj.bias" in weights,
            qk_norm="midlayer.self_attn.q_norm.weight" in weights,
            norm_before_residual=bool(fields.get("norm_before_residual") or False),
        )
    except ConfigError as err:
        raise HeadMismatchError(f"{where}: {err}") from None


def _vocab_maps(weights: dict[str, torch.Tensor], cfg: Eagle3Config, where: Path) -> None:
    """Check (and complete) ``d2t`` / ``t2d`` in ``weights`` in place: a head without them drafts
    over the whole vocabulary; ``t2d`` is derived from ``d2t`` where absent; both must fit the
    target vocabulary and agree (distinct target ids, each marked in ``t2d``)."""
    v, vd = cfg.vocab_size, cfg.draft_vocab_size
    if "d2t" not in weights:
        if vd != v:
            raise HeadMismatchError(f"{where}: draft_vocab_size {vd} < vocab_size {v} but no d2t mapping")
        weights["d2t"] = torch.zeros(vd, dtype=torch.long)
        weights["t2d"] = torch.ones(v, dtype=torch.bool)
    d2t = weights["d2t"] = weights["d2t"].long()
    if tuple(d2t.shape) != (vd,):
        raise HeadMismatchError(f"{where}: vocabulary mismatch: d2t has shape {tuple(d2t.shape)}, "
                                f"draft_vocab_size is {vd}")
    ids = torch.arange(vd) + d2t  # [Vd] target id of each draft id
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise HeadMismatchError(f"{where}: vocabulary mismatch: d2t maps draft ids outside the target vocabulary "
                                f"(target ids {int(ids.min())}..{int(ids.max())}, vocab_size {v})")
    if len(torch.unique(ids)) != vd:
        raise HeadMismatchError(f"{where}: d2t maps two draft ids to the same target id")
    if "t2d" not in weights:
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        weights["t2d"] = t2d
    t2d = weights["t2d"] = weights["t2d"].bool()
    if tuple(t2d.shape) != (v,):
        raise HeadMismatchError(f"{where}: vocabulary mismatch: t2d has shape {tuple(t2d.shape)}, the target "
                                f"vocabulary has {v} tokens")
    if int(t2d.sum()) != vd or not bool(t2d[ids].all()):
        raise HeadMismatchError(f"{where}: t2d disagrees with d2t (t2d marks {int(t2d.sum())} tokens, d2t maps "
                                f"{vd} draft ids)")


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
    weights.pop("embed_tokens.weight", None)  # checked against the target's, which the head shares
    head = Eagle3Head(cfg, target.embed_tokens)
    _vocab_maps(weights, cfg, path)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise HeadMismatchError(f"{path} ({fmt} format): missing weights {missing}, unexpected weights {unexpected}")
    shapes = [f"{k} {tuple(w.shape)} (expected {tuple(expected[k].shape)})" for k, w in weights.items()
              if w.shape != expected[k].shape]
    if shapes:
        raise HeadMismatchError(f"{path} ({fmt} format): weight shapes disagree with config.json: {'; '.join(shapes)}")
    head.load_state_dict(weights)
    return head.to(device=target.device, dtype=dtype).eval()
