"""MoE routing in one kernel: softmax over the router logits, top-k, optional renormalisation,
each pair's physical slot (EPLB) and the per-expert counts (atomics).

At decode batch sizes each of these steps was a kernel of its own (with the counts' zeros, ones
and sums, about a dozen a MoE layer under expert parallelism), each a launch of ~1-2 us for a
few nanoseconds of work; one program per token does them all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.moe import RouteTally, Routing, SlotTable
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


# first_token and the counted rows change from step to step: specialising on their values (1, or
# multiples of 16) would compile new variants in the middle of a run.
@triton.jit(do_not_specialize=["first_token", "count_lo", "count_hi"])
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    slots_ptr,
    log2phy_ptr,
    replicas_ptr,
    counts_ptr,
    slot_counts_ptr,
    num_experts,
    stride_l,
    stride_phy,
    first_token,
    count_lo,
    count_hi,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_SLOTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per token: the whole row of E logits in registers, k rounds of argmax.
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
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
    used = slot < TOP_K
    tl.store(weights_ptr + t * TOP_K + slot, top_w, mask=used)
    tl.store(ids_ptr + t * TOP_K + slot, top_i, mask=used)
    phys = top_i
    if HAS_TABLE:
        replicas = tl.load(replicas_ptr + top_i, mask=used, other=1)
        replica = (first_token + t) % replicas
        phys = tl.load(log2phy_ptr + top_i * stride_phy + replica, mask=used, other=0)
        tl.store(slots_ptr + t * TOP_K + slot, phys, mask=used)
    if COUNT:
        row = tl.zeros([BLOCK_K], tl.int64) + t  # a vector: the interpreter's atomics need one
        counted = used & (row >= count_lo) & (row < count_hi)
        one = tl.full([BLOCK_K], 1, tl.int64)
        tl.atomic_add(counts_ptr + top_i, one, mask=counted)
        if COUNT_SLOTS:
            tl.atomic_add(slot_counts_ptr + phys, one, mask=counted)


@register_triton("moe_route")
def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    table: SlotTable | None = None,
    tally: RouteTally | None = None,
) -> Routing:
    # The contract, shapes included, of `pdmesh.kernels.moe.moe_route`, which calls this.
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    slots = torch.empty_like(ids) if table is not None else ids
    if not num_tokens:
        return Routing(weights, ids, slots)
    counts = tally.expert_counts if tally is not None else ids
    slot_counts = tally.slot_counts if tally is not None else None
    for name, buf in (("expert", counts), ("slot", slot_counts)):
        if buf is not None and buf.dtype != torch.int64:
            raise ValueError(f"{name} counts must be int64, got {buf.dtype}")
    logits = last_dim_contiguous(router_logits)
    block_e = triton.next_power_of_2(num_experts)
    use_pdl = pdl(device)
    _route_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        slots,
        table.log2phy if table is not None else ids,
        table.replicas if table is not None else ids,
        counts,
        slot_counts if slot_counts is not None else ids,
        num_experts,
        logits.stride(0),
        table.log2phy.stride(0) if table is not None else 0,
        table.first_token if table is not None else 0,
        tally.lo if tally is not None else 0,
        tally.hi if tally is not None else 0,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        HAS_TABLE=table is not None,
        COUNT=tally is not None,
        COUNT_SLOTS=slot_counts is not None,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        USE_PDL=use_pdl,
        num_warps=4 if block_e >= 512 else 1,
        **pdl_launch(use_pdl),
    )
    return Routing(weights, ids, slots)
