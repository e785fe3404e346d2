"""The attention's prologue: q and k normalised per head (optional) and rotated, and the step's
K and V stored in the paged cache; one kernel on GPUs (triton/rope_store.py)."""

from __future__ import annotations

import torch

from pdmesh.kernels.attention import store_kv_cache
from pdmesh.kernels.backend import pick
from pdmesh.kernels.norm import rms_norm
from pdmesh.kernels.rotary import apply_rotary


def rotary_and_store_kv(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 stores nothing for the token
    *,
    q_norm: torch.Tensor | None = None,  # [D]: per-head RMSNorm weights of q and k, or None
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: float = 1.0,  # an fp8 cache stores key / k_scale, value / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """rms_norm (with q_norm / k_norm), then apply_rotary, then store_kv_cache of the rotated
    keys; returns the rotated query [T, H, D]."""
    impl = pick("rotary_and_store_kv", query, rotary_and_store_kv_unfused)
    return impl(
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_norm=q_norm, k_norm=k_norm, eps=eps, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def rotary_and_store_kv_unfused(
    positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping, *,
    q_norm=None, k_norm=None, eps=0.0, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The prologue as its three kernels (each picking its own implementation)."""
    if q_norm is not None:
        query, key = rms_norm(query, q_norm, eps), rms_norm(key, k_norm, eps)
    query, key = apply_rotary(positions, query, key, cos_sin_cache)
    store_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return query
