"""The target architectures the hf engine reproduces exactly, and the refusal of every other one.

The engine does not run a target through ``model.generate``: it feeds the model its own masks
(per-row lengths, draft blocks, trees), its own cache and its own attention function
(``rollout.engine.attention``), and takes the prefill's logits from the final hidden state. A family
is **accepted** when the engine's forwards reproduce the model's own cache-free forward for it:
greedy speculation equals greedy decoding and every behaviour log-prob equals a cache-free
forward's log-softmax (fp32, within 1e-4). ``tests/rollout/test_architectures.py`` shows that
for every entry of :data:`FAMILIES` on a tiny random model of the family; a new family joins by
adding one line here and one to that test's matrix.

What each entry states is what the engine needs beyond the model's own modules:

- ``final_norm``: the attribute of the decoder stack holding the final norm (its output is the
  hidden state the logits are computed from, and what the drafter's training data records);
- ``logits``: how the causal LM turns that hidden state into logits (:data:`LOGIT_RULES`):
  ``plain`` (the lm_head alone), ``scaled`` (times ``config.logit_scale``), ``divided`` (over
  ``config.logits_scaling``) or ``softcapped`` (``c tanh(l / c)`` with
  ``config.final_logit_softcapping``).

Everything else (grouped-query attention, rope variants, biases, q/k norms, scaled embeddings,
tied or untied embeddings, MLP and norm shapes) is the model's own code, run as it is. Attention
sliding windows and soft-capping are applied by ``rollout.engine.attention``.

**Refused** (:class:`UnsupportedModelError`, when the engine is built, before the first token):
a causal LM class not in :data:`FAMILIES` (its attention, cache or logits may hold something the
engine does not reproduce), and within accepted classes the settings the engine cannot
reproduce: rotary scalings that change with the sequence length (``dynamic``, ``longrope``: a
cached decode is then another function than the trainer's forward over the whole sequence),
chunked attention, attention sinks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rollout.config import ConfigError


class UnsupportedModelError(ConfigError):
    """A target the engine does not reproduce exactly: names the model class and what is not reproduced."""

    def __init__(self, model_class: str, reason: str):
        self.model_class, self.reason = model_class, reason
        super().__init__("model.target", f"{model_class} is refused by the hf engine: {reason}")


def _plain(logits: torch.Tensor, config) -> torch.Tensor:
    return logits


def _scaled(logits: torch.Tensor, config) -> torch.Tensor:
    return logits * config.logit_scale


def _divided(logits: torch.Tensor, config) -> torch.Tensor:
    return logits / config.logits_scaling


def _softcapped(logits: torch.Tensor, config) -> torch.Tensor:
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


LOGIT_RULES: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "plain": _plain, "scaled": _scaled, "divided": _divided, "softcapped": _softcapped}


@dataclass(frozen=True)
class Family:
    """One accepted causal LM class: its final norm's attribute and its logit rule."""

    model_class: str
    final_norm: str = "norm"
    logits: str = "plain"

    def __post_init__(self) -> None:
        if self.logits not in LOGIT_RULES:
            raise ConfigError("logits", f"unknown logit rule {self.logits!r}", allowed=sorted(LOGIT_RULES))


FAMILIES: dict[str, Family] = {f.model_class: f for f in (
    Family("LlamaForCausalLM"),
    Family("MistralForCausalLM"),
    Family("MinistralForCausalLM"),
    Family("MixtralForCausalLM"),
    Family("Qwen2ForCausalLM"),
    Family("Qwen3ForCausalLM"),
    Family("Qwen3MoeForCausalLM"),
    Family("GemmaForCausalLM"),
    Family("Gemma2ForCausalLM", logits="softcapped"),
    Family("Gemma3ForCausalLM", logits="softcapped"),
    Family("PhiForCausalLM", final_norm="final_layernorm"),
    Family("Phi3ForCausalLM"),
    Family("OlmoForCausalLM"),
    Family("Olmo2ForCausalLM"),
    Family("GraniteForCausalLM", logits="divided"),
    Family("CohereForCausalLM", logits="scaled"),
    Family("Cohere2ForCausalLM", logits="scaled"),
    Family("StableLmForCausalLM"),
    Family("Starcoder2ForCausalLM"),
    Family("SmolLM3ForCausalLM"),
    Family("HeliumForCausalLM"),
    Family("GlmForCausalLM"),
    Family("Exaone4ForCausalLM"),
)}

# rotary scalings whose frequencies depend on the length of the sequence being run
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _rope_types(config) -> set[str]:
    """The rope types a config names (``rope_parameters`` / ``rope_scaling``, per layer type or not)."""
    found = set()
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if not isinstance(params, dict):
            continue
        nested = [v for v in params.values() if isinstance(v, dict)]
        for p in (nested or [params]):
            kind = p.get("rope_type", p.get("type"))
            if kind is not None:
                found.add(str(kind))
    return found


def check_architecture(model_class: str, config) -> Family:
    """The accepted family of ``model_class`` with ``config``, or :class:`UnsupportedModelError`
    naming the class and what the engine does not reproduce."""
    family = FAMILIES.get(model_class)
    if family is None:
        raise UnsupportedModelError(
            model_class, "not among the architectures it reproduces exactly (rollout.architectures.FAMILIES: "
            f"{', '.join(sorted(FAMILIES))}); a family joins once the architecture tests show it exact")
    rope = _rope_types(config) & LENGTH_DEPENDENT_ROPE
    if rope:
        raise UnsupportedModelError(
            model_class, f"rope type {sorted(rope)[0]!r} rescales the rotary frequencies with the sequence length, "
            "so a cached decode is not the function the trainer's forward computes (use a static rope scaling: "
            "'linear', 'llama3' or 'yarn')")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(model_class, "chunked attention (attention_chunk_size) is not reproduced")
    if getattr(config, "sinks", None) or getattr(config, "use_sinks", None):
        raise UnsupportedModelError(model_class, "attention sinks are not reproduced")
    return family


def family_of(model) -> Family:
    """:func:`check_architecture` for a loaded causal LM."""
    return check_architecture(type(model).__name__, model.config)
