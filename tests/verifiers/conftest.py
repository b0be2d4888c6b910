"""Every verifier test runs on both chain backends: the fused C++ kernel (verifiers/native.py,
what the CPU uses) and the PyTorch code (any device; the fallback). The native run fails,
rather than skips, where the kernel cannot be built.

A test parametrised with ``verifier_cases.on_devices`` also takes the device it runs on
(``device``): the CPU on each chain backend, CUDA (marker ``gpu``) on the PyTorch code alone."""

from __future__ import annotations

import pytest
import torch

from verifiers import native


@pytest.fixture(autouse=True, params=["native", "torch"])
def chain_backend(request):
    with native.forced(request.param == "native"):
        yield request.param


@pytest.fixture
def device(request) -> torch.device:
    """The device named by ``on_devices``'s parameter; a ``cuda`` case skips where there is none."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)
