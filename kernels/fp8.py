"""FP8 (float8 e4m3) W8A8 matmuls: per-output-channel weight scales, per-token activation scales.

A quantized matrix is (q, scale): q float8_e4m3fn [R, K], scale float32 [R], and q[r] * scale[r]
approximates row r. `quantize_rows` makes one from a matrix (weights at load, activations per
matmul: each row is scaled so that its largest magnitude lands on e4m3's largest finite value, 448).

`fp8_linear(x, q, scale, bias)` is y = x W^T (+ b) with W = (q, scale): the references quantize x
per token, multiply the two fp8 matrices exactly in fp32 and scale the [T, N] result by
x_scale[t] * w_scale[n] (what an fp8 tensor-core GEMM with rowwise scales computes, up to fp32
summation order). The Triton side (`triton/fp8_linear.py`) runs the same product with
`torch._scaled_mm` on Hopper, and at batch 1 inside CUDA graphs a GEMV that reads the fp8 weight
and keeps the activations in bf16 (weight-only: the step only streams the weight).
"""

from __future__ import annotations

import torch

from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.backend import pick

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# The smallest scale used: an all-zero row keeps scale 1 / FP8_MAX * this, never 0 (no 0 / 0).
_MIN_AMAX = 1e-12


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, K] -> (q float8_e4m3fn [R, K], scale float32 [R]) with q[r] * scale[r] ~ x[r]."""
    return pick("fp8_quantize_rows", x, quantize_rows_ref)(x)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(_MIN_AMAX)  # [R]
    scale = amax / FP8_MAX
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., R, K], scale [..., R]) -> q * scale in `dtype` (computed in fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, K], qweight: [N, K] fp8, scale: [N] fp32, bias: [N] -> [T, N] in x's dtype
    return pick("fp8_linear", x, fp8_linear_ref)(x, qweight, scale, bias)


def fp8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    xq, xs = quantize_rows_ref(x)
    return scaled_mm_ref(xq, xs, qweight, scale, bias, x.dtype)


def scaled_mm_ref(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq [T, K], x_scale [T]) @ (qweight [N, K], w_scale [N])^T (+ bias) -> [T, N] out_dtype.
    fp8 values are exact in fp32, so the product differs from a tensor core's only in the order
    of its fp32 sums."""
    y = xq.float() @ qweight.float().t()
    y = y * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_silu_and_mul_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """An MLP's down projection of its [gate | up] output: fp8_linear(silu(gate) * up)."""
    # x: [T, 2K], qweight: [N, K] fp8, scale: [N] -> [T, N]
    fn = pick("fp8_silu_and_mul_linear", x, fp8_silu_and_mul_linear_ref)
    return fn(x, qweight, scale, bias)


def fp8_silu_and_mul_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return fp8_linear_ref(silu_and_mul_ref(x), qweight, scale, bias)
