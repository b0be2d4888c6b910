"""The EAGLE-3 head rounded to int8 weights: a drafter that reads a quarter of fp32's bytes.

A batch-1 draft step is bound by reading the head's weights (about 8.2M of them: the ``fc``, one
decoder layer, the 8192-row lm_head). Speculation stays exact whatever the drafter is: the
verifier tests each draft against the draft law q the head actually sampled it from, so a
cheaper head changes how many drafts are accepted, never the law of the emitted tokens or their
behaviour log-probs. :func:`quantize_int8_` therefore rounds each linear layer of the head, in
place, to ``scale[n] * q`` with integers ``|q| <= 127`` and one scale per output row (symmetric,
``scale = max |w[n]| / 127``): the head *is* that model from then on, in every path (the
Python forwards compute with the rounded values). Each weight is registered with
``rollout.kernels.native_linear.register_int8``, so the decoding kernel packs it as int8 panels whose
outputs are the same bits as fp32 panels of the rounded weight.

On the shipped head tau did not move measurably (``scripts/measure_acceptance.py --seeds 2
--drafter-weights stored | int8``, lossless chain K = 7: arithmetic 2.28 / 2.32 at T = 1 and 3.86 /
3.84 at T = 0, general 2.02 / 2.05 and 2.13 / 2.12), while a batch-1 draft step went from 1.2 to
0.9 ms (``scripts/bench_rollout.py --int8-head``). From batch 8 up a draft step is bound by FMAs
and the int8 panels gain nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from rollout.config import ConfigError
from rollout.kernels import native_linear

DRAFTER_WEIGHTS = ("stored", "int8")  # the hf backend's ``drafter_weights`` option
LEVELS = 127  # integers in [-LEVELS, LEVELS]


def check_drafter_weights(value: str) -> str:
    """``value`` if it is one of :data:`DRAFTER_WEIGHTS`, else a ConfigError naming
    ``backend_options.drafter_weights`` and the allowed values."""
    if value not in DRAFTER_WEIGHTS:
        raise ConfigError("backend_options.drafter_weights", f"unknown drafter weights {value!r}",
                          allowed=DRAFTER_WEIGHTS)
    return value


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` for ``weight [N, K]`` (float32): ``values[n, k] = fl(q[n, k] * scales[n])``
    with integers ``|q| <= 127`` nearest to ``weight / scales`` and ``scales[n] = max |weight[n]| / 127``
    (an all-zero row keeps scale 0 and zeros). Signed zeros come out as +0 (the kernel's widened
    integer 0 times a scale is +0)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"int8_rows needs a 2-D float32 weight, got {str(weight.dtype)} {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        row = int(torch.nonzero(~torch.isfinite(weight).all(1))[0, 0])
        raise ValueError(f"int8_rows: row {row} of the weight has a non-finite value")
    w = weight.detach()
    scales = w.abs().amax(1) / LEVELS  # [N]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / safe[:, None]).clamp_(-LEVELS, LEVELS)
    values = q * scales[:, None] + 0.0  # (+ 0.0: -0 becomes +0, nothing else changes)
    return values.contiguous(), scales.contiguous()


@torch.no_grad()
def quantize_int8_(module: nn.Module) -> int:
    """Round every ``nn.Linear`` weight of ``module`` in place as :func:`int8_rows` says and
    register its scales for the kernel's int8 panels; returns how many. Biases stay as they are.
    Idempotent: a rounded weight rounds to itself."""
    n = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            values, scales = int8_rows(layer.weight.data.float())
            layer.weight.data.copy_(values)
            native_linear.register_int8(layer.weight, scales)
            n += 1
    return n
