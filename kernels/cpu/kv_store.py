"""The KV-cache store on the CPU: each token's key and value rows copied into their slots by one
Numba loop.

The reference (`index_copy_` after a check for padding slots) costs a host read of the check and
two indexed copies per layer: about 100 us a call in a decode step of the default model at 8
sequences on the 2-core EPYC build machine, 3 ms of a 90 ms step. A copy changes no bits.
fp32 keys and an fp32 cache only; anything else (an fp8 cache among them) keeps the reference.
"""

from __future__ import annotations

import torch

from pdmesh.kernels.attention import store_kv_cache_ref
from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.cpu.jit import njit_cached


@njit_cached()
def _store(key, value, k_cache, v_cache, slots):  # pragma: no cover (compiled)
    # key, value: [T, Hkv, D]; caches [NB, BS, Hkv, D]; slots [T] (-1: padding, skipped).
    block_size = k_cache.shape[1]
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        block, row = slot // block_size, slot % block_size
        k_cache[block, row] = key[t]
        v_cache[block, row] = value[t]


@register_cpu("store_kv_cache")
def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    fp32 = key.dtype is value.dtype is k_cache.dtype is v_cache.dtype is torch.float32
    if not (fp32 and k_cache.is_contiguous() and v_cache.is_contiguous()):
        store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                           v_scale=v_scale)  # fmt: skip
        return
    _store(key.numpy(), value.numpy(), k_cache.numpy(), v_cache.numpy(), slot_mapping.numpy())
