"""Rotary position embedding (rotate-half / "neox" style) on the first rot_dim dims of q and k.

One program per token: it reads the token's cos/sin row once and rotates every query and key head.
Dims past rot_dim are copied. Each product is rounded to the input dtype before the sum, as the
reference computes `x1 * cos - x2 * sin` in the input dtype, so bf16 results match it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in fp32 for halves [BLOCK_H, BLOCK_HALF] and cos / sin
    [BLOCK_HALF]: cos and sin rounded to x's dtype, each product rounded to it before the sum,
    as the reference computes them."""
    dtype = x1.dtype
    c = cos.to(dtype).to(tl.float32)[None, :]
    s = sin.to(dtype).to(tl.float32)[None, :]
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = (a * c).to(dtype).to(tl.float32) - (b * s).to(dtype).to(tl.float32)
    o2 = (b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)
    return o1, o2


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    t,
    cos,
    sin,
    stride_xt,
    stride_xh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (i < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + (t * NUM_HEADS + h) * HEAD_DIM  # out: a new [T, NUM_HEADS, HEAD_DIM]
    x1 = tl.load(src + i, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0)
    o1, o2 = rotate_halves(x1, x2, cos, sin)
    tl.store(dst + i, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + i, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        pmask = (h < NUM_HEADS) & (j < HEAD_DIM)
        tl.store(dst + j, tl.load(src + j, mask=pmask), mask=pmask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    cache_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
    row = cache_ptr + tl.load(pos_ptr + t) * stride_cache
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(row + i, mask=i < HALF, other=0.0)  # [BLOCK_HALF] float32
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0)
    _rotate_heads(
        q_ptr, q_out_ptr, t, cos, sin, stride_qt, stride_qh,
        NUM_HEADS, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, t, cos, sin, stride_kt, stride_kh,
        NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_HKV, BLOCK_HALF, BLOCK_PASS,
    )  # fmt: skip


@register_triton("apply_rotary")
def apply_rotary(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32: cos halves then sin halves
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    query, key = last_dim_contiguous(query), last_dim_contiguous(key)
    cos_sin_cache = last_dim_contiguous(cos_sin_cache)
    pass_dims = head_dim - 2 * half
    use_pdl = pdl(query.device)
    _rotary_kernel[(num_tokens,)](
        positions,
        cos_sin_cache,
        query,
        key,
        q_out,
        k_out,
        cos_sin_cache.stride(0),
        *query.stride()[:2],
        *key.stride()[:2],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(pass_dims) if pass_dims else 0,
        USE_PDL=use_pdl,
        num_warps=4,
        **pdl_launch(use_pdl),
    )
    return q_out, k_out
