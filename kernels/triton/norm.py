"""RMSNorm and residual-add + RMSNorm in one pass over each row.

A program normalises BLOCK_R rows of BLOCK_C columns held in registers: one row for hidden sizes
in the thousands, several for per-head norms (head_dim 128) so programs are not tiny. The math
follows the reference: sum of squares in fp32, the normalised row rounded to the input dtype,
then multiplied by the weight (in the promoted dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous

# Elements one program aims to hold: rows are batched until a tile reaches this size.
_TILE_ELEMENTS = 4096


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    ADD_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    # The weight first: with programmatic dependent launch the kernel that wrote x may still be
    # running until the wait.
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        # Rounded to the residual dtype before normalising, as the reference's `x + residual`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 1) / n_cols + eps)  # [BLOCK_R]
    y = (x32 * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    res_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = last_dim_contiguous(x).reshape(-1, hidden)  # [R, C]
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, res_dtype)
    out = torch.empty(n_rows, hidden, dtype=out_dtype, device=x.device)
    res2 = res_out = None
    if residual is not None:
        res2 = last_dim_contiguous(residual).reshape(-1, hidden)
        res_out = torch.empty(n_rows, hidden, dtype=res_dtype, device=x.device)
    if n_rows:
        block_c = triton.next_power_of_2(hidden)
        # Rows a program takes: from the row size only, so that a new row count never compiles
        # the kernel again mid-step (see decode_attention.py); short batches mask the rest.
        block_r = max(1, _TILE_ELEMENTS // block_c)
        use_pdl = pdl(x.device)
        _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else out,
            n_rows,
            hidden,
            eps,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            ADD_RESIDUAL=residual is not None,
            USE_PDL=use_pdl,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=min(16, max(1, block_r * block_c // 512)),
            **pdl_launch(use_pdl),
        )
    shape = x.shape
    return out.view(shape), None if res_out is None else res_out.view(shape)


@register_triton("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., C] -> [..., C]
    return _launch(x, None, weight, eps, x.dtype)[0]


@register_triton("fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., C] -> (normed [..., C], x + residual [..., C])
    out, res_out = _launch(x, residual, weight, eps, torch.promote_types(x.dtype, residual.dtype))
    assert res_out is not None
    return out, res_out
