"""What the ``hf`` engine runs its forwards with: :class:`EngineOptions`, passed to
``Engine(options=...)`` and from there to every part that reads it (the model runner, the
kernels' ``routed`` block and packing, the stack loop, the C++ layers and draft calls).

Every option is on by default, the engine's fastest path; each one off keeps a slower path that
computes the same thing (the same bits, or where the docs say so the same up to float32
rounding), for A/B measurements (``scripts/bench_rollout.py``'s rows) and the tests that compare
the two. A benchmark row built with ``EngineOptions(fused=False)`` says what it runs
(:meth:`EngineOptions.describe`); nothing is switched through module globals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollout.config import ConfigError


@dataclass(frozen=True)
class EngineOptions:
    # False: every module's own forward (no rollout.kernels.fused_layers; the linear kernel still on)
    fused: bool = True
    # False: the decoder stack's own forward around the fused layers (no fused_layers.stack_forward loop)
    fused_stack: bool = True
    # False: the fused norms compute with torch's rms_norm, not csrc/norm.cpp (which the C++ layers need)
    native_norm: bool = True
    # False: every weight packed as fp32 panels (no bf16 or int8 panels, no AMX tiles)
    compact_panels: bool = True
    # False: bf16-valued weights as bf16 panels, not AMX tiles (where native_linear.amx_available())
    amx: bool = True
    # False: the stack's layers run one by one from Python, not csrc/layer.cpp
    native_layers: bool = True
    # False: each layer's C++ call (hr_decoder_layer) from the Python loop, not one hr_decoder_stack call
    layer_stack: bool = True
    # False: every draft step through the head's forward, not one hr_draft_layer call
    native_draft: bool = True
    # False: a chain's steps drafted one C++ call each (native_draft.step), not one hr_draft_chain call
    draft_chains: bool = True
    # False: every row prefilled on its own, identical prompts too (ModelRunner.start)
    share_prompts: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ConfigError(f"options.{f.name}", f"must be true or false, got {value!r}")

    def off(self) -> tuple[str, ...]:
        """The names of the options set to False, in field order."""
        return tuple(f.name for f in dataclasses.fields(self) if not getattr(self, f.name))

    def describe(self) -> str:
        """What these options change from the defaults, for a benchmark row's label: ``"fused off"``,
        ``"amx off, layer_stack off"``; ``""`` for the defaults."""
        return ", ".join(f"{name} off" for name in self.off())
