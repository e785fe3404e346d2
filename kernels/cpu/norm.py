"""RMSNorm (alone and fused with the residual add before it) on the CPU: one Numba loop over the
rows instead of the reference's seven torch operations.

At a decode batch the reference spends its time starting operations on a few kilobytes: in a
decode step of the default model at 8 sequences on the 2-core EPYC build machine its 60 calls
took 6.6 ms of a 90 ms step, about 110 us each. Each row's sum of squares is accumulated in
float64 (the reference's is a float32 pairwise sum: the two agree to float32's last bit or
two), then `x * (1 / sqrt(mean + eps))` and the weight's product as the reference computes them
in float32. fp32 only; other dtypes keep the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.cpu.jit import njit_cached
from pdmesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref

# Rows below this run on one thread: starting the pool costs more than a few rows of work.
PARALLEL_ROWS = 64


@njit_cached()
def _norm_row(x, residual, weight, eps, out, res_out, i, add):  # pragma: no cover (compiled)
    # Row i: res_out[i] = x[i] + residual[i] (add) or x[i]; out[i] = rms_norm(res_out[i]).
    hidden = x.shape[1]
    total = 0.0  # float64
    for j in range(hidden):
        v = x[i, j] + residual[i, j] if add else x[i, j]
        res_out[i, j] = v
        total += np.float64(v) * np.float64(v)
    inv = np.float32(1.0) / np.sqrt(np.float32(total) / np.float32(hidden) + eps)
    for j in range(hidden):
        out[i, j] = weight[j] * (res_out[i, j] * inv)


@njit_cached()
def _norm_rows(x, residual, weight, eps, out, res_out, add):  # pragma: no cover (compiled)
    for i in range(x.shape[0]):
        _norm_row(x, residual, weight, eps, out, res_out, i, add)


@njit_cached(parallel=True)
def _norm_parallel(x, residual, weight, eps, out, res_out, add):  # pragma: no cover (compiled)
    for i in prange(x.shape[0]):
        _norm_row(x, residual, weight, eps, out, res_out, i, add)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype is weight.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()


def _normalize(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, add: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if add else out  # without add: a scratch copy of x
    kernel = _norm_parallel if x.shape[0] >= PARALLEL_ROWS else _norm_rows
    arrays = (x.numpy(), residual.numpy(), weight.numpy(), np.float32(eps))
    kernel(*arrays, out.numpy(), res_out.numpy(), add)
    return out, res_out


@register_cpu("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]
    if not _fits(x, weight):
        return rms_norm_ref(x, weight, eps)
    out, _ = _normalize(x, x, weight, eps, add=False)
    return out


@register_cpu("fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [T, H] -> (rms_norm(x + residual), x + residual)
    if _fits(x, weight) and _fits(residual, weight) and residual.shape == x.shape:
        return _normalize(x, residual, weight, eps, add=True)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
