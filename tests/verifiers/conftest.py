"""Every verifier test runs on both chain backends: the fused C++ kernel (verifiers/native.py,
what the CPU uses) and the PyTorch code (any device; the fallback). The native run fails,
rather than skips, where the kernel cannot be built."""

from __future__ import annotations

import pytest

from verifiers import native


@pytest.fixture(autouse=True, params=["native", "torch"])
def chain_backend(request):
    with native.forced(request.param == "native"):
        yield request.param
