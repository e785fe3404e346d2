"""Attention's prologue on the CPU for models without per-head norms (Llama, the default model):
the query rotated, the key rotated straight into its cache slot and the value copied beside it,
in one Numba call a layer where rotary.py and kv_store.py took three (the query's rotation, the
key's, the store), each costing its start on a few kilobytes. The arithmetic is rotary.py's, so
the bits are the same. fp32 and dense caches only; per-head norms or an fp8 cache take the
kernels one by one (the wrapper's reference).
"""

from __future__ import annotations

import torch

from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.cpu.jit import njit_cached
from pdmesh.kernels.cpu.rotary import PARALLEL_ROWS, rotate, rotate_rows, rotate_token
from pdmesh.kernels.prologue import rotary_and_store_kv_unfused


@njit_cached()
def _rotate_key_into_cache(k, v, positions, cache, k_cache, v_cache, slots):  # pragma: no cover
    # k, v: [T, Hkv, D]; caches [NB, BS, Hkv, D]; slots [T] (-1: padding, nothing stored).
    block_size = k_cache.shape[1]
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        block, row = slot // block_size, slot % block_size
        rotate_token(k[t], positions[t], cache, k_cache[block, row])
        v_cache[block, row] = v[t]


@njit_cached()
def _prologue(q, k, v, positions, cache, q_out, k_cache, v_cache, slots):  # pragma: no cover
    rotate_rows(q, positions, cache, q_out, 0, q.shape[0])
    _rotate_key_into_cache(k, v, positions, cache, k_cache, v_cache, slots)


@register_cpu("rotary_and_store_kv")
def rotary_and_store_kv(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    **options: object,  # q_norm, k_norm, eps, k_scale, v_scale: see kernels/prologue.py
) -> torch.Tensor:
    tensors = (query, key, value, cos_sin_cache, k_cache, v_cache)
    fp32 = all(t.dtype is torch.float32 for t in tensors)
    plain = options.get("q_norm") is None and query.dim() == key.dim() == 3
    dense = k_cache.is_contiguous() and v_cache.is_contiguous()
    if not (fp32 and plain and dense):
        args = (positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping)
        return rotary_and_store_kv_unfused(*args, **options)
    positions = positions.to(torch.int64)
    if query.shape[0] >= PARALLEL_ROWS:  # a prefill: the query's rotation on every thread
        q_out = rotate(query, positions, cos_sin_cache)
        arrays = (key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        _rotate_key_into_cache(*(a.numpy() for a in arrays))
        return q_out
    q_out = torch.empty(query.shape, dtype=query.dtype)
    arrays = (query, key, value, positions, cos_sin_cache, q_out, k_cache, v_cache, slot_mapping)
    _prologue(*(a.numpy() for a in arrays))
    return q_out
