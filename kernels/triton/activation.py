"""SiLU(gate) * up over a merged [gate | up] projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import last_dim_contiguous

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32, with silu's result rounded to `dtype` first as the reference
    (two separate torch ops) does; returns `dtype`. Shared with the fused MoE GEMM epilogue."""
    g = gate.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    # Grid: (rows, column blocks); x row: [gate (n_cols) | up (n_cols)].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    out = silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@register_triton("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2I] -> [..., I]
    inter = x.shape[-1] // 2
    x2 = last_dim_contiguous(x).reshape(-1, 2 * inter)
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(_BLOCK, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
