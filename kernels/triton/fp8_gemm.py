"""An fp8 W8A8 GEMM for decode-sized batches, with the weight as the tile's tall side.

    y[t, n] = sum_k xq[t, k] * wq[n, k] * x_scale[t] * w_scale[n] (+ bias[n])   -> bf16

cuBLASLt's fp8 GEMM tiles the token side in 64 or 128 rows: at a decode batch of 16-64 tokens
most of each tile is empty and the GEMM took 1.65x the time its weight bytes need (H100, 8B at
batch 64; BENCHMARKS.md). Here each program owns BLOCK_N rows of the weight and BLOCK_T tokens
and computes the transposed product (w @ x^T, "swap AB"): the tensor core's M side is the
weight, which has rows to spare, and BLOCK_T can be as small as 16. Both operands are read
K-major as they lie in memory (what Hopper's fp8 MMA takes). Same inputs and result as
`torch._scaled_mm` with rowwise scales, up to the order of the fp32 sums.

Programmatic dependent launch: the weight's first tile is requested before the wait for the
kernel before (the activation's quantization), which writes xq and x_scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdmesh.kernels.triton.device import num_sms
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


class Fp8GemmConfig(NamedTuple):
    block_n: int  # weight rows a program owns
    block_t: int  # tokens a program owns (16 or more: the MMA's smallest side)
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _fp8_gemm_kernel(
    w_ptr,
    ws_ptr,
    x_ptr,
    xs_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    T,
    stride_w,
    stride_x,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Grid: (cdiv(N, BLOCK_N), cdiv(T, BLOCK_T)). acc: [BLOCK_N, BLOCK_T] = w tile @ x tile^T.
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    t_ok = rt < T
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rt.to(tl.int64)[None, :] * stride_x + rk[:, None]  # [BLOCK_K, BLOCK_T]
    # The weight is constant: its first tile is on its way before the wait.
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk[None, :] < K), other=0.0)
    wait_for_previous(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=t_ok[None, :] & ((k0 + rk)[:, None] < K), other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 + BLOCK_K + rk)[None, :] < K), other=0.0)
    w_scale = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    x_scale = tl.load(xs_ptr + rt, mask=t_ok, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rt.to(tl.int64)[None, :] * stride_y + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


def fp8_gemm_config(t: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig:
    """The launch shape: the smallest token tile that holds the batch, and weight tiles small
    enough that every SM gets a program (o and down of an 8B model have only 4,096 rows)."""
    block_t = max(16, min(64, triton.next_power_of_2(t)))
    block_n = 64 if triton.cdiv(n, 64) >= num_sms(device) else 32
    return Fp8GemmConfig(block_n, block_t, min(128, triton.next_power_of_2(k)), 4, 4)


# The largest batch the kernel takes by default (above it cuBLASLt's tiles are full).
MAX_TOKENS = 64


def fits(xq: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `fp8_gemm` takes the product: a decode-sized batch, both operands dense along K."""
    return (
        xq.dim() == 2
        and 0 < xq.shape[0] <= MAX_TOKENS
        and xq.stride(-1) == 1
        and qweight.stride(-1) == 1
        and xq.shape[1] == qweight.shape[1]
    )


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8GemmConfig | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """(xq fp8 [T, K], x_scale fp32 [T]) @ (qweight fp8 [N, K], w_scale fp32 [N])^T (+ bias [N])
    -> [T, N] in out_dtype."""
    t, k = xq.shape
    n = qweight.shape[0]
    cfg = config or fp8_gemm_config(t, n, k, xq.device)
    use_pdl = pdl(xq.device) if use_pdl is None else use_pdl
    y = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(t, cfg.block_t))
    _fp8_gemm_kernel[grid](
        qweight,
        w_scale,
        xq,
        x_scale,
        bias if bias is not None else w_scale,
        y,
        n,
        k,
        t,
        qweight.stride(0),
        xq.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_T=cfg.block_t,
        BLOCK_K=cfg.block_k,
        USE_PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(use_pdl),
    )
    return y
