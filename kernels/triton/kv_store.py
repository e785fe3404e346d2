"""Writing a step's new keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.kv_quant import is_fp8
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


@triton.jit
def round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as torch rounds:
    the cast of the result is then exact whatever rounding the cast does (Triton's interpreter
    truncates, and drops the carry into the exponent)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2^-6 it is subnormal, with steps of 2^-9.
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0  # 1.5 * 2^23 steps: adding it rounds |x| to a multiple of step
    rounded = (tl.abs(x) + magic) - magic
    # x's sign bit onto |x| rounded, as bits: a negation compiled as 0 - r on a GPU (H100) gave
    # +0.0 for a small negative x where torch keeps -0.0.
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def as_stored(x, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as a cache stores it: for an fp8 cache x / scale in fp32, saturated, then rounded (as
    kernels/kv_quant.py's quantize); otherwise x."""
    if FP8:  # one return: Triton types every return of a function, taken or not
        x = round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX))
    return x


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # of k_cache and v_cache, which share one layout
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per token: all its heads at once, [BLOCK_H, BLOCK_D].
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    k = as_stored(k, k_scale, FP8, FP8_MAX)
    v = as_stored(v, v_scale, FP8, FP8_MAX)
    # int64 offsets: a layer's cache can exceed 2^31 elements.
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, head) strides of both caches [NB, BS, Hkv, D]; every kernel here reads or
    writes K and V at the same offsets and assumes a dense last dimension."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a dense last dimension")
    return k_cache.stride()[:3]


@register_triton("store_kv_cache")
def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 skips the token
    *,
    k_scale: float = 1.0,  # an fp8 cache stores key / k_scale
    v_scale: float = 1.0,
) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    _, page, num_kv_heads, head_dim = k_cache.shape
    use_pdl = pdl(key.device)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        *key.stride()[:2],
        *value.stride()[:2],
        *cache_strides(k_cache, v_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8(k_cache.dtype),
        FP8_MAX=torch.finfo(k_cache.dtype).max if is_fp8(k_cache.dtype) else 0.0,
        USE_PDL=use_pdl,
        num_warps=4,
        **pdl_launch(use_pdl),
    )
