"""Registering int8 scales on a weight that already holds integers times them (a head loaded
rounded, then registered) is seen by the next ``routed`` block: its panels become int8, with the
bits of the fp32 panels it had."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollout.kernels import native_linear
from rollout.kernels.quantize import int8_rows


@pytest.mark.skipif(not native_linear.available(), reason="the native linear kernel needs an AVX-512 CPU")
def test_scales_registered_later_switch_unchanged_bytes_to_int8_panels():
    net = nn.Linear(64, 48, bias=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        values, scales = int8_rows(net.weight.detach().clone())
        net.weight.copy_(values)
        for _ in range(2):  # packed, then kept (stamped with the digests)
            with native_linear.routed(net):
                before = net(x)
        assert native_linear._buffers[net.weight].dtype == torch.float32  # no scales registered yet
        native_linear.register_int8(net.weight, scales)  # the bytes do not change
        with native_linear.routed(net):
            after = net(x)
        assert native_linear._buffers[net.weight].dtype == torch.int8
    assert torch.equal(after, before)
