"""Helpers shared by the tests of the kernel's packed-panel formats (bf16, int8 panels and AMX tiles against
fp32 panels); no test functions here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.kernels import native_linear
from rollout.options import EngineOptions


def pack_without(weight: torch.Tensor, option: str) -> torch.Tensor:
    """``weight`` packed with the engine option ``option`` off (``EngineOptions(<option>=False)``)."""
    return native_linear.pack(weight, options=EngineOptions(**{option: False}))


def fp32_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed as fp32 panels whatever its values (``EngineOptions(compact_panels=False)``)."""
    return pack_without(weight, "compact_panels")


def assert_fp32_bits(w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor, full: torch.Tensor) -> None:
    """``packed`` panels of ``w`` give the bits of its fp32 panels ``full`` at every row count of the
    register groups and their tails and in a second row block, and torch's F.linear up to rounding."""
    k = w.shape[1]
    g = torch.Generator().manual_seed(k)
    for m in [*range(1, 30), 64, 257]:
        x = torch.randn(m, k, generator=g)
        got = native_linear.linear(x, w, b, packed)
        assert torch.equal(got, native_linear.linear(x, w, b, full))
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)
