"""What an FP8 KV cache element means: float8 e4m3 values times a per-layer scale (one for K, one
for V), written saturated. The torch reference paths quantize and dequantize through here; the
Triton kernels do the same arithmetic inline (`kernels/triton/kv_store.py`).

A cache of any other dtype stores K and V as they are (cast to its dtype) and its scales are 1.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
# e4m3fn's largest finite value. Values beyond it saturate: the format has no infinity, and a
# NaN written into a page would poison every query that reads it.
FP8_KV_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x ([..., D], any float dtype) as the cache stores it: x / scale in fp32, saturated and
    rounded to the nearest fp8 value; other caches: x cast to their dtype."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    top = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-top, top).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache elements x as values of `dtype`: fp8 ones times their scale (in fp32, then cast)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    if scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)
