"""The policy a peft LoRA trainer samples from: its merged weights, without merging in place.

With a ``PeftModel`` the trainer's forward is base(x) + scaling * B(A(x)) per adapted layer.
The rollouts draft and verify with a plain model of the base architecture instead (the
engine's fused kernels read each layer's ``weight``, which in a LoRA layer is the base
weight alone), holding the merged weights W + scaling * B @ A. ``merged_state_dict``
computes them from the base weights and each active adapter (peft's own
``get_delta_weight`` / its variants' ``merge_safe``: DoRA included) into new tensors, so the
trainer's model is never changed; the names are the base model's (no ``base_model.model.``
prefix, no ``.base_layer``, a ``modules_to_save`` copy under the name of the module it
replaces). Other peft methods (prompt tuning, IA3, ...) are refused: they have no merged
weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rollout.config import ConfigError


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def check_lora(model: nn.Module) -> None:
    """Refuse a peft model whose adapters have no merged weights (anything but LoRA)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    for name in model.active_adapters:
        kind = str(getattr(model.peft_config[name], "peft_type", "?")).split(".")[-1]
        if kind != "LORA":
            raise ConfigError("peft_config", f"adapter {name!r} is {kind}: speculative rollouts sample the merged "
                              "weights of the adapted policy, which only LoRA has", allowed=["LoraConfig"])
    for path, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer) or \
                isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper):
            raise ConfigError("peft_config", f"{path} is a {type(module).__name__}, which the rollouts cannot merge "
                              "(LoRA layers and modules_to_save only)", allowed=["LoraConfig"])


def _own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """A module's own parameters and buffers: (name, tensor, persistent)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p.detach(), True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b.detach(), name not in module._non_persistent_buffers_set


def _merged_layer(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA layer's base weight (and bias) with its active, unmerged adapters added, as new tensors."""
    base = layer.get_base_layer()
    out = {name: t for name, t, _ in _own(base)}
    if layer.disable_adapters:
        return out
    weight, bias = base.weight.detach(), getattr(base, "bias", None)
    merged, new_bias = weight.float().clone(), None if bias is None else bias.detach().float().clone()
    variants = getattr(layer, "lora_variant", {})
    for name in layer.active_adapters:
        if name not in layer.scaling or name in layer.merged_adapters:  # not on this layer / already in the base
            continue
        if name in variants:  # DoRA and the other variants: their own out-of-place merge
            merged = variants[name].merge_safe(layer, name, merged)
        else:
            merged = merged + layer.get_delta_weight(name).float()
        if getattr(layer, "lora_bias", {}).get(name):
            new_bias = new_bias + layer.lora_B[name].bias.detach().float() * layer.scaling[name]
    out["weight"] = merged.to(weight.dtype)
    if new_bias is not None:
        out["bias"] = new_bias.to(bias.dtype)
    return out


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor, bool]]:
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    if isinstance(module, LoraLayer):
        persistent = {name: keep for name, _, keep in _own(module.get_base_layer())}
        for name, tensor in _merged_layer(module).items():
            yield prefix + name, tensor, persistent[name]
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = module.active_adapters[0] if module.active_adapters else None
        use = module.original_module if module.disable_adapters or active not in module.modules_to_save else \
            module.modules_to_save[active]
        yield from _walk(use, prefix)
        return
    for name, tensor, keep in _own(module):
        yield prefix + name, tensor, keep
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.")


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapted policy's weights under the base model's names (a plain model's ``state_dict``
    keys): LoRA layers merged out of place, the trainer's model untouched."""
    return {name: t for name, t, keep in _walk(model.get_base_model(), "") if keep}


@torch.no_grad()
def plain_copy(model: nn.Module) -> nn.Module:
    """A model of the base architecture holding the merged weights (eval mode, no gradients)."""
    from contextlib import nullcontext

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # every weight is loaded below: skipping the random init only saves time
        no_init_weights = nullcontext
    base = model.get_base_model()
    with no_init_weights():
        plain = type(base)(base.config).to(base.dtype)
    tensors = {name: t for name, t, _ in _walk(base, "")}
    plain.load_state_dict(merged_state_dict(model), strict=True)
    for name, buf in plain.named_buffers():  # the non-persistent ones (rotary frequencies) too
        if name in tensors:
            buf.copy_(tensors[name])
    return plain.eval().requires_grad_(False)
