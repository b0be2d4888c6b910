"""Checks of a training config that read files, run before Ray or any model starts.

``check_files(cfg)`` parses a JSONL task file (every record, the way the trainer will) and
checks that the EAGLE-3 head fits the target by reading both ``config.json`` files and the
head's safetensors *header* (names and shapes, no weights): hidden size, vocabulary,
the ``fc`` weight, and the three aux layers against the target's depth. Every failure is a
:class:`rollout.config.ConfigError` naming the dotted field (``task.path``,
``model.drafter``, ``model.target.aux_layer_ids``).

Simplification: a ``.gguf`` target is not opened here (its shapes sit in a binary header);
the head is then checked on its own and fully against the target when the actors load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout.config import ConfigError

# SmolLM2-135M-Instruct, the embedded target, when its safetensors cache is not built yet
EMBEDDED_SHAPES = {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30}


def check_files(cfg) -> None:
    """Raise ConfigError when the task file or the drafter head would fail once the run starts."""
    if cfg.task.source == "jsonl":
        check_jsonl(cfg.task.path, cfg.task.prompts_per_step)
    check_target_layers(cfg.model.target)
    if getattr(cfg.rollout, "backend", "hf") == "hf":
        check_target_architecture(cfg.model.target)
    if cfg.model.drafter is not None and cfg.rollout.spec.mode != "off":
        check_head_fits(cfg.model.drafter_path(), cfg.model.target)


def check_jsonl(path: str, prompts_per_step: int | None = None) -> None:
    """The task file reads and has records: at least ``prompts_per_step`` of them (each step
    samples that many distinct prompts from it; fewer would silently give smaller steps)."""
    from trainers.tasks.problems import load_jsonl

    try:
        problems = load_jsonl(path)
    except (ValueError, UnicodeDecodeError, OSError) as err:
        raise ConfigError("task.path", str(err)) from None
    if not problems:
        raise ConfigError("task.path", f"{path}: no records (the file is empty or blank)")
    if prompts_per_step is not None and len(problems) < prompts_per_step:
        raise ConfigError("task.prompts_per_step", f"{prompts_per_step} distinct prompts a step, but {path} holds "
                          f"{len(problems)} records")


def _read_json(path: Path, field: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(field, f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{path} is not a JSON object")
    return data


def target_shapes(target) -> dict[str, int] | None:
    """hidden_size, vocab_size, num_hidden_layers of the target, or None for a GGUF file."""
    if target.path is None:
        from rollout.models import embedded_cache_dir

        cached = embedded_cache_dir() / "config.json"
        raw = _read_json(cached, "model.target.path") if cached.is_file() else EMBEDDED_SHAPES
    else:
        p = Path(target.path).expanduser()
        if p.suffix == ".gguf":
            return None
        raw = _read_json(p / "config.json", "model.target.path")
        raw = raw.get("text_config") or raw
    try:
        return {k: int(raw[k]) for k in ("hidden_size", "vocab_size", "num_hidden_layers")}
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError("model.target.path", f"the target's config.json lacks a usable {err}") from None


def _head_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The flat EAGLE fields of either head format (see rollout/eagle3_io.py)."""
    if raw.get("speculators_model_type") == "eagle3":
        fields = dict(raw.get("transformer_layer_config") or {})
        for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            fields[k] = raw.get(k)
        return fields
    fields = dict(raw)
    if fields.get("eagle_aux_hidden_state_layer_ids") is None:
        fields["eagle_aux_hidden_state_layer_ids"] = (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
    return fields


def _fc_in_features(head: Path) -> int | None:
    """Input width of the head's ``fc`` (3 x the target hidden size) from the safetensors header."""
    st = head / "model.safetensors"
    if not st.is_file():
        if (head / "pytorch_model.bin").is_file():
            return None  # a pickle: no header to read without loading it
        raise ConfigError("model.drafter", f"no weights in {head} (model.safetensors or pytorch_model.bin)")
    from safetensors import safe_open

    try:
        with safe_open(str(st), framework="pt") as f:
            names = set(f.keys())
            name = next((n for n in ("fc.weight", "model.fc.weight") if n in names), None)
            if name is None:
                raise ConfigError("model.drafter", f"{st} has no fc.weight (not an EAGLE-3 head?)")
            return int(f.get_slice(name).get_shape()[1])
    except ConfigError:
        raise
    except Exception as err:  # a truncated or foreign file
        raise ConfigError("model.drafter", f"cannot read the weights header of {st}: {err}") from None


def check_target_architecture(target) -> None:
    """A target folder whose architecture the hf engine refuses (``rollout.architectures``) is
    refused here, from its ``config.json`` alone, before Ray or any model starts."""
    if target.path is None or Path(target.path).expanduser().suffix == ".gguf":
        return  # the embedded target is a Llama; a GGUF is checked once loaded
    from transformers import AutoConfig

    from rollout.architectures import check_architecture

    path = Path(target.path).expanduser()
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError("model.target.path", f"cannot read {path / 'config.json'}: {err}") from None
    names = getattr(config, "architectures", None) or []
    if names:
        check_architecture(names[0], config)


def check_target_layers(target) -> None:
    shapes = target_shapes(target)
    if shapes is None or target.aux_layer_ids is None:
        return
    n = shapes["num_hidden_layers"]
    if not all(i < n for i in target.aux_layer_ids):
        raise ConfigError("model.target.aux_layer_ids", f"{list(target.aux_layer_ids)} out of range for a "
                          f"{n}-layer target (need three ids in [0, {n}))")


def check_head_fits(head: Path, target) -> None:
    fields = _head_fields(_read_json(head / "config.json", "model.drafter"))
    fc_in = _fc_in_features(head)
    shapes = target_shapes(target)
    try:
        h, vocab = int(fields["hidden_size"]), int(fields["vocab_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError("model.drafter", f"{head}/config.json lacks a usable {err}") from None
    ids = fields.get("eagle_aux_hidden_state_layer_ids")
    where = f"{head} does not fit the target"
    if shapes is not None and h != shapes["hidden_size"]:
        raise ConfigError("model.drafter", f"{where}: head hidden_size {h}, target hidden_size {shapes['hidden_size']}")
    if fc_in is not None and fc_in != 3 * h:
        raise ConfigError("model.drafter", f"{head}: fc takes {fc_in} features, expected 3 x hidden_size {h}")
    if shapes is None:
        return
    if vocab != shapes["vocab_size"]:
        raise ConfigError("model.drafter", f"{where}: head vocab_size {vocab}, target vocab_size {shapes['vocab_size']}")
    n = shapes["num_hidden_layers"]
    if ids is not None:
        ids = tuple(int(i) for i in ids)
        if len(ids) != 3 or not all(0 <= i < n for i in ids):
            raise ConfigError("model.drafter", f"{where}: the head's aux layers {list(ids)} do not exist in a {n}-layer target")
        from rollout.models import default_aux_layer_ids

        captured = target.aux_layer_ids or default_aux_layer_ids(n)
        if tuple(captured) != ids:
            raise ConfigError("model.target.aux_layer_ids", f"the target would capture layers {list(captured)}, the "
                              f"head was trained on {list(ids)}; set model.target.aux_layer_ids: {list(ids)}")


def check_local_ray_fits(cfg) -> None:
    """The local Ray ``scripts.train`` starts (``ray.address`` null, no ``RAY_ADDRESS``) has
    ``ray.num_cpus`` CPUs (null: this machine's) and this machine's GPUs: actors that ask for more
    would wait for them for ever, so such a config is refused naming the fields."""
    import math
    import os

    r = cfg.rollout
    cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    if r.num_actors * r.threads_per_actor > cpus:
        raise ConfigError("rollout.num_actors", f"{r.num_actors} actors x rollout.threads_per_actor "
                          f"{r.threads_per_actor} ask the local Ray for {r.num_actors * r.threads_per_actor} CPUs; "
                          f"it has {cpus} (ray.num_cpus): the actors would wait for them for ever")
    if r.num_gpus_per_actor > 0:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if math.ceil(r.num_actors * r.num_gpus_per_actor) > gpus:
            raise ConfigError("rollout.num_gpus_per_actor", f"{r.num_actors} actors x {r.num_gpus_per_actor:g} GPUs "
                              f"need {math.ceil(r.num_actors * r.num_gpus_per_actor)}; this machine's local Ray has "
                              f"{gpus} (set it to 0, or join a cluster with ray.address)")
