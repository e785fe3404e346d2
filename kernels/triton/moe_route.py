"""MoE routing: softmax over the router logits, top-k, optional renormalisation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import last_dim_contiguous


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per token: the whole row of E logits in registers, k rounds of argmax.
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # [BLOCK_E]; padded experts have p == 0
    p = tl.where(e < num_experts, p, -1.0)  # never picked, even over real zeros
    slot = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.argmax(p, 0)
        top_w = tl.where(slot == j, best, top_w)
        top_i = tl.where(slot == j, idx.to(tl.int64), top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)  # slots >= TOP_K hold 0
    tl.store(weights_ptr + t * TOP_K + slot, top_w, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, top_i, mask=slot < TOP_K)


@register_triton("moe_route")
def moe_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, ids [T, k] int64
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens:
        logits = last_dim_contiguous(router_logits)
        block_e = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            logits,
            weights,
            ids,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=4 if block_e >= 512 else 1,
        )
    return weights, ids
