"""Fused MoE experts: align pairs by expert, two grouped GEMMs, sum each token's k results
(batches of a few tokens take two GEMV kernels instead: moe_gemv.py).

    align      topk_ids [T, k]            -> rows grouped by local expert, padded to BLOCK_M
    w13 GEMM   x [T, H], w13 [E, 2I, H]   -> h = silu(gate) * up: [T*k, I]
    w2 GEMM    h, w2 [E, H, I]            -> y = weight * (h @ w2[e].T): [T*k, H]
    combine    y                          -> out [T, H], summing the slots held on this rank

Slots routed to experts of other ranks (expert parallelism) are never computed and count zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.moe_align import moe_align_block_size
from pdmesh.kernels.triton.moe_gemm import moe_gemm_config, w2_gemm, w13_silu_gemm
from pdmesh.kernels.triton.moe_gemv import MAX_TOKENS, moe_experts_gemv

_BLOCK_H = 1024


@triton.jit
def _combine_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    hidden,
    first_expert,
    num_local,
    stride_yt,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Grid: (tokens, hidden blocks). y rows t*k .. t*k+k-1 are token t's slots.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - first_expert
        if (e >= 0) & (e < num_local):  # a slot held on another rank was never computed
            y = tl.load(y_ptr + (t * TOP_K + j) * stride_yt + cols, mask=col_mask, other=0.0)
            acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@register_triton("moe_experts")
def moe_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    first_expert: int,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
) -> Tensor:
    # The contract, shapes included, of `pdmesh.kernels.moe.moe_experts`, which calls this.
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be dense in their last dimension")
    small = x.shape[0] <= MAX_TOKENS
    fn = moe_experts_gemv if small else moe_experts_grouped
    return fn(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale)


def moe_experts_grouped(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    first_expert: int,
    w13_scale: Tensor | None = None,
    w2_scale: Tensor | None = None,
) -> Tensor:
    """`moe_experts` by the grouped GEMMs, whatever the batch size (benchmarks compare)."""
    num_tokens, hidden = x.shape
    num_local, _, _ = w13.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x = last_dim_contiguous(x)
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.reshape(-1).contiguous()  # [T*k]
    cfg = moe_gemm_config(num_tokens, x.dtype)
    align = moe_align_block_size(topk_ids, first_expert, num_local, cfg.block_m)
    h = w13_silu_gemm(x, w13, align, top_k, cfg, w13_scale)  # [T*k, I]
    y = w2_gemm(h, w2, weights, align, cfg, w2_scale)  # [T*k, H]
    block_h = min(_BLOCK_H, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y,
        topk_ids,
        out,
        hidden,
        first_expert,
        num_local,
        y.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out
