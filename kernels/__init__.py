"""Attention, MoE and norm kernels: a torch reference for each, Triton versions for GPU.

Callers use only the wrappers exported here; each picks its implementation per call
(see `backend.py`).
"""

from pdmesh.kernels.activation import silu_and_mul
from pdmesh.kernels.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    store_kv_cache,
)
from pdmesh.kernels.linear import linear, silu_and_mul_linear
from pdmesh.kernels.moe import RouteTally, Routing, SlotTable, moe_experts, moe_route
from pdmesh.kernels.norm import fused_add_rms_norm, rms_norm
from pdmesh.kernels.prologue import rotary_and_store_kv
from pdmesh.kernels.rotary import apply_rotary

__all__ = [
    "RouteTally",
    "Routing",
    "SlotTable",
    "apply_rotary",
    "fused_add_rms_norm",
    "linear",
    "moe_experts",
    "moe_route",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_and_store_kv",
    "silu_and_mul",
    "silu_and_mul_linear",
    "store_kv_cache",
]
