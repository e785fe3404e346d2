"""Triton implementations of the kernels, registered with `pdmesh.kernels.backend`.

Imported on demand by `backend.pick` the first time a kernel could run on Triton; importing this
package registers every kernel below under its wrapper's name.
"""

from pdmesh.kernels.triton import (
    activation,
    decode_attention,
    fp8_linear,
    gemv,
    kv_store,
    moe_experts,
    moe_route,
    norm,
    prefill_attention,
    rope_store,
    rotary,
)

__all__ = [
    "activation",
    "decode_attention",
    "fp8_linear",
    "gemv",
    "kv_store",
    "moe_experts",
    "moe_route",
    "norm",
    "prefill_attention",
    "rope_store",
    "rotary",
]
