"""FP8 W8A8 projections on the GPU: activations quantized per token by a Triton kernel, the
product by `torch._scaled_mm` with rowwise scales (cuBLASLt's fp8 tensor-core GEMM on Hopper).

    quantize   x [T, K] (or silu(gate) * up of [T, 2K])  -> xq fp8 [T, K], x_scale [T]
    GEMM       xq @ wq^T * x_scale[t] * w_scale[n]        -> y [T, N] bf16

A batch-1 decode step inside a CUDA graph instead runs the GEMV of `gemv.py` on the fp8 weight
(bf16 activations, scales applied to its sums): the step only streams the weight, and the GEMV
reads it at the memory's rate where two kernels (quantize, then a GEMM of one row) would not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh import envs
from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.fp8 import _MIN_AMAX, FP8_DTYPE, FP8_MAX, scaled_mm_ref
from pdmesh.kernels.triton.activation import silu_mul
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.gemv import GemvConfig, gemv
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous

_BLOCK_K = 2048


@triton.jit
def _load_act(ptrs, mask, K, GATED: tl.constexpr):
    """A tile of the activation in fp32; GATED: silu(gate) * up (rounded to x's dtype first,
    as the reference's separate SiLU kernel does), gate at `ptrs` and up K elements further."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        x = silu_mul(x, tl.load(ptrs + K, mask=mask, other=0.0), x.dtype)
    return x.to(tl.float32)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in fp32
    arithmetic: adding then subtracting 2^(e + 20) leaves multiples of 2^(e - 3), e4m3's spacing
    at v's binade e (2^-9 below 2^-6, its subnormals). The cast to fp8 after is then exact, so
    the result does not depend on how a backend rounds that cast (Triton's interpreter does
    not carry a rounded-up mantissa into the exponent)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e + 20)
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX_: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Grid: (rows,). Two passes over the row: its largest magnitude, then the scaled values.
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = (k0 + ks) < K
        amax = tl.maximum(amax, tl.abs(_load_act(x_row + k0 + ks, mask, K, GATED)))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX_
    for k0 in range(0, K, BLOCK_K):
        mask = (k0 + ks) < K
        v = _load_act(x_row + k0 + ks, mask, K, GATED) / scale
        v = _round_to_e4m3(tl.minimum(tl.maximum(v, -FP8_MAX_), FP8_MAX_))
        tl.store(q_ptr + row * stride_q + k0 + ks, v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, K] -> (q fp8 [R, K], scale float32 [R]); gated: x is [R, 2K] = [gate | up] and
    silu(gate) * up is quantized (the MLP's activation fused into the quantization)."""
    x = last_dim_contiguous(x)
    rows, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        use_pdl = pdl(x.device)
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            k,
            x.stride(0),
            q.stride(0),
            FP8_MAX_=FP8_MAX,
            MIN_AMAX=_MIN_AMAX,
            GATED=gated,
            BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(k)),
            USE_PDL=use_pdl,
            num_warps=4,
            **pdl_launch(use_pdl),
        )
    return q, scale


register_triton("fp8_quantize_rows")(quantize_rows)


def scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq [T, K], x_scale [T]) @ (qweight [N, K], w_scale [N])^T (+ bias) -> [T, N]: the fp8
    GEMM with rowwise scales (bf16 output), or its fp32 emulation for other output dtypes."""
    if out_dtype != torch.bfloat16:  # cuBLASLt's rowwise-scaled fp8 GEMM writes bf16 only
        return scaled_mm_ref(xq, x_scale, qweight, w_scale, bias, out_dtype)
    # qweight.t() is [K, N] column-major: the layout the fp8 GEMM takes its second operand in.
    y = torch._scaled_mm(
        xq,
        qweight.t(),
        scale_a=x_scale[:, None],
        scale_b=w_scale[None, :],
        out_dtype=out_dtype,
    )
    return y + bias if bias is not None else y


def fp8_gemv_config(rows: int, n: int, k: int, gated: bool = False) -> GemvConfig:
    """The GEMV's launch shape for an fp8 weight, the fastest measured on an H100 over
    Llama-3.1-8B's projections (bench/gemv_gpu.py --quantization fp8; BENCHMARKS.md). At one row,
    a weight wider than it is deep (q/k/v, gate/up) sums each 2,048-wide K tile at once: fewer
    registers held across the loop, more of the weight in flight (q/k/v 11.8 against 13.5 us,
    gate/up 43.8 against 46.4). The square o projection and the gated down projection keep the
    elementwise accumulator, faster for them (8.1 against 8.6, 25.7 against 28.4)."""
    if rows == 1 and not gated and n > k:
        return GemvConfig(8, min(2048, triton.next_power_of_2(k)), 4, 1, reduce_each_tile=True)
    block_k = 512 if rows > 1 else 1024
    return GemvConfig(
        block_n=8, block_k=min(block_k, triton.next_power_of_2(k)), num_warps=4, num_stages=1
    )


def gemv_fits(x: torch.Tensor, qweight: torch.Tensor, gated: bool = False) -> bool:
    """Whether the fp8 GEMV takes `x @ qweight.T`: a few rows (PDMESH_GEMV_MAX_ROWS), dense
    along K. Unlike bf16 there is no library kernel that streams an fp8 weight at batch 1, so
    wide weights take the GEMV too."""
    k = qweight.shape[-1] * (2 if gated else 1)
    return (
        x.dim() == 2
        and x.shape[1] == k
        and 0 < x.shape[0] <= envs.gemv_max_rows()
        and x.stride(-1) == 1
        and qweight.stride(-1) == 1
    )


def _in_graph(x: torch.Tensor) -> bool:
    # As gemv.py: Triton's launch from Python costs more than a batch-1 product takes.
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _fp8_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, gated
) -> torch.Tensor:
    n, k = qweight.shape
    cfg = fp8_gemv_config(x.shape[0], n, k, gated)
    return gemv(x, qweight, bias, config=cfg, gated=gated, scale=scale)


@register_triton("fp8_linear")
def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, K], qweight: [N, K] fp8, scale: [N] -> [T, N]
    if _in_graph(x) and gemv_fits(x, qweight):
        return _fp8_gemv(x, qweight, scale, bias, gated=False)
    xq, xs = quantize_rows(x)
    return scaled_mm(xq, xs, qweight, scale, bias, x.dtype)


@register_triton("fp8_silu_and_mul_linear")
def fp8_silu_and_mul_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, 2K] = [gate | up], qweight: [N, K] fp8, scale: [N] -> [T, N]
    if _in_graph(x) and gemv_fits(x, qweight, gated=True):
        return _fp8_gemv(x, qweight, scale, bias, gated=True)
    xq, xs = quantize_rows(x, gated=True)
    return scaled_mm(xq, xs, qweight, scale, bias, x.dtype)
