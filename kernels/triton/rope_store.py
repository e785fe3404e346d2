"""The attention's prologue in one kernel: per-head RMSNorm of q and k (optional: Qwen3's
q_norm / k_norm), rotary embedding of both, and the step's K and V written into their
paged-cache slots.

A batch-1 decode step ran these as up to four kernels a layer (two norms, rotary, the store) of a
few microseconds each, more than their bytes take (bench/results/profile-moe-b1-nopdl-h100-
2026-12-07.txt). One program per token does all of it for every head: it reads the token's
cos/sin row once, normalises and rotates its query heads (written out: the attention reads
them) and its key heads (written only to the cache, which is where attention reads keys), and
copies its value heads to the cache. The arithmetic is each unfused kernel's in turn (norm.py,
rotary.py, kv_store.py): without norms the results are theirs bit for bit; with them the sum of
a head's squares may be added in another order than norm.py's (a GPU reduces each tile its own
way), so an element may differ in its last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.kv_quant import is_fp8
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.kv_store import as_stored, cache_strides
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous
from pdmesh.kernels.triton.rotary import rotate_halves


@triton.jit
def _normed(x, inv, w_ptr, cols, n: tl.constexpr, OFFSET: tl.constexpr):
    """x's columns OFFSET + cols normalised by `inv` ([BLOCK_H, 1]), rounded to x's dtype, times
    the weight (norm.py's arithmetic), back in x's dtype."""
    w = tl.load(w_ptr + OFFSET + cols, mask=cols < n, other=0.0).to(tl.float32)
    return ((x.to(tl.float32) * inv).to(x.dtype).to(tl.float32) * w).to(x.dtype)


@triton.jit
def _heads(
    x_ptr,
    w_ptr,
    t,
    cos,
    sin,
    eps,
    stride_xt,
    stride_xh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """A token's heads [BLOCK_H, *] normalised (HAS_NORM) and rotated, in x's dtype: (first
    rotated half, second rotated half, the dims past the rotary ones)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    j = tl.arange(0, BLOCK_PASS)[None, :]
    mask = (h < NUM_HEADS) & (i < HALF)
    pmask = (h < NUM_HEADS) & (j < HEAD_DIM - 2 * HALF)
    src = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(src + i, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0)
    xp = tl.load(src + 2 * HALF + j, mask=pmask, other=0.0)  # [BLOCK_H, BLOCK_PASS]
    if HAS_NORM:
        # The squares summed over the whole head in one reduction, as norm.py sums a row.
        d = tl.arange(0, BLOCK_D)[None, :]
        x = tl.load(src + d, mask=(h < NUM_HEADS) & (d < HEAD_DIM), other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x1 = _normed(x1, inv, w_ptr, i, HALF, 0)
        x2 = _normed(x2, inv, w_ptr, i, HALF, HALF)
        xp = _normed(xp, inv, w_ptr, j, HEAD_DIM - 2 * HALF, 2 * HALF)
    o1, o2 = rotate_halves(x1, x2, cos, sin)
    return o1.to(x1.dtype), o2.to(x1.dtype), xp


@triton.jit
def _rope_store_kernel(
    pos_ptr,
    rope_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    eps,
    k_scale,
    v_scale,
    stride_rope,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # of k_cache and v_cache, which share one layout
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    wait_for_previous(USE_PDL)
    row = rope_ptr + tl.load(pos_ptr + t) * stride_rope
    cos = tl.load(row + i, mask=i < HALF, other=0.0)  # [BLOCK_HALF] float32
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0)
    q1, q2, qp = _heads(
        q_ptr, q_norm_ptr, t, cos, sin, eps, stride_qt, stride_qh,
        NUM_HEADS, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_PASS, BLOCK_D, HAS_NORM,
    )  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    j = tl.arange(0, BLOCK_PASS)[None, :]
    mask = (h < NUM_HEADS) & (c < HALF)
    pmask = (h < NUM_HEADS) & (j < HEAD_DIM - 2 * HALF)
    dst = q_out_ptr + (t * NUM_HEADS + h) * HEAD_DIM  # q_out: a new [T, NUM_HEADS, HEAD_DIM]
    out_dtype = q_out_ptr.dtype.element_ty
    tl.store(dst + c, q1.to(out_dtype), mask=mask)
    tl.store(dst + HALF + c, q2.to(out_dtype), mask=mask)
    tl.store(dst + 2 * HALF + j, qp.to(out_dtype), mask=pmask)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # -1: a padding token, nothing stored
        k1, k2, kp = _heads(
            k_ptr, k_norm_ptr, t, cos, sin, eps, stride_kt, stride_kh,
            NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_HKV, BLOCK_HALF, BLOCK_PASS, BLOCK_D, HAS_NORM,
        )  # fmt: skip
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        kmask = (hk < NUM_KV_HEADS) & (c < HALF)
        kpmask = (hk < NUM_KV_HEADS) & (j < HEAD_DIM - 2 * HALF)
        # int64 offsets: a layer's cache can exceed 2^31 elements.
        at = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + hk * stride_ch
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + at + c, as_stored(k1, k_scale, FP8, FP8_MAX).to(cache_dtype), kmask)
        tl.store(
            k_cache_ptr + at + HALF + c, as_stored(k2, k_scale, FP8, FP8_MAX).to(cache_dtype), kmask
        )
        tl.store(
            k_cache_ptr + at + 2 * HALF + j,
            as_stored(kp, k_scale, FP8, FP8_MAX).to(cache_dtype),
            kpmask,
        )
        d = tl.arange(0, BLOCK_D)[None, :]
        vmask = (hk < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + hk * stride_vh + d, mask=vmask)
        tl.store(v_cache_ptr + at + d, as_stored(v, v_scale, FP8, FP8_MAX).to(cache_dtype), vmask)


@register_triton("rotary_and_store_kv")
def rotary_and_store_kv(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32: cos halves then sin halves
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 stores nothing for the token
    *,
    q_norm: torch.Tensor | None = None,  # [D] per-head RMSNorm weights, with k_norm
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # the query normalised and rotated, [T, H, D]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    has_norm = q_norm is not None
    if has_norm and (k_norm is None or q_norm.dtype != query.dtype or k_norm.dtype != key.dtype):
        raise ValueError("q_norm and k_norm come together, in the dtype of q and k")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    query, key, value = (last_dim_contiguous(x) for x in (query, key, value))
    cos_sin_cache = last_dim_contiguous(cos_sin_cache)
    fp8 = is_fp8(k_cache.dtype)
    use_pdl = pdl(query.device)
    _rope_store_kernel[(num_tokens,)](
        positions,
        cos_sin_cache,
        query,
        key,
        value,
        q_norm if has_norm else query,
        k_norm if has_norm else key,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        float(eps),
        float(k_scale),
        float(v_scale),
        cos_sin_cache.stride(0),
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        *cache_strides(k_cache, v_cache),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(1, head_dim - 2 * half)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_NORM=has_norm,
        FP8=fp8,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        USE_PDL=use_pdl,
        num_warps=4,
        **pdl_launch(use_pdl),
    )
    return q_out
