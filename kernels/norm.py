"""RMSNorm, alone and fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from pdmesh.kernels.backend import pick


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H] (or [..., H]); computed in float32 as Hugging Face does.
    return pick("rms_norm", x, rms_norm_ref)(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    return pick("fused_add_rms_norm", x, fused_add_rms_norm_ref)(x, residual, weight, eps)


def fused_add_rms_norm_ref(x, residual, weight, eps):
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual
