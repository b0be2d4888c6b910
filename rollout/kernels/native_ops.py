"""The decoding attention (``csrc/attention.cpp``) and RMS norm (``csrc/norm.cpp``) of the
native library (:mod:`rollout.kernels.native_lib`), as ``rollout.kernels.fused_layers`` calls them inside
``native_linear.routed``: fp32 on the CPU, no autograd. Each returns None where its inputs do not
fit (another dtype or device, a head size the kernel has no path for, gradients wanted); the
caller then runs torch's op.
"""

from __future__ import annotations

import torch

from rollout.kernels import native_lib


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """Attention through ``csrc/attention.cpp``: ``query [B, Hq, T, D]``, ``key`` and ``value
    [B, Hkv, L, D]`` (views of one cache layout: the same strides), ``mask [B, 1, T, L]`` bool
    (True: may attend); returns ``[B, T, Hq, D]`` (contiguous), or None where it does not fit
    (then the caller runs torch's attention)."""
    b, hq, t, d = query.shape
    lib = native_lib._lib
    if not (lib is not None and query.dtype == key.dtype == value.dtype == torch.float32
            and mask.dtype == torch.bool and query.device.type == key.device.type == "cpu"
            and d in (16, 32, 64, 128) and key.dim() == 4 and key.shape == value.shape
            and key.stride() == value.stride() and key.shape[0] == b and key.shape[3] == d and hq % key.shape[1] == 0
            and mask.shape == (b, 1, t, key.shape[2])
            and query.stride(-1) == key.stride(-1) == mask.stride(-1) == 1
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))):
        return None
    out = torch.empty(b, t, hq, d, dtype=torch.float32)
    qs, ks, ms = query.stride(), key.stride(), mask.stride()
    status = lib.hr_attend(query.data_ptr(), qs[0], qs[1], qs[2], key.data_ptr(), value.data_ptr(), ks[0], ks[1],
                           ks[2], mask.data_ptr(), ms[0], ms[2], out.data_ptr(), b, t, hq, key.shape[1],
                           key.shape[2], d, scale)
    return out if status == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Llama's RMS norm of ``x [..., N]`` with ``weight [N]`` through ``csrc/norm.cpp`` (fp32, CPU,
    no autograd), or None where it does not fit (then the caller runs torch's)."""
    n, lib = x.shape[-1], native_lib._lib
    if not (lib is not None and x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type
            == "cpu" and weight.shape == (n,) and weight.is_contiguous() and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    xs = x.contiguous()
    out = torch.empty_like(xs)
    lib.hr_rms_norm(xs.data_ptr(), weight.data_ptr(), out.data_ptr(), xs.numel() // n, n, eps)
    return out
