"""MoE routing in one kernel: softmax over the router logits, top-k, optional renormalisation,
each pair's physical slot (EPLB) and the per-expert counts (atomics).

At decode batch sizes each of these steps was a kernel of its own (with the counts' zeros, ones
and sums, about a dozen a MoE layer under expert parallelism), each a launch of ~1-2 us for a
few nanoseconds of work; one program per token does them all.

For a decode step's few tokens the router's projection joins them (`moe_gate_route`): programs
over the experts compute the logits as the GEMV does, and the last of them to finish routes
every token (`arrivals.last_to_arrive`), one kernel where the GEMV and this took two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.moe import RouteTally, Routing, SlotTable, moe_gate_route_ref
from pdmesh.kernels.triton.arrivals import arrival_counters, last_to_arrive
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.gemv import fits, load_weight_tile, load_x_tile, x_tile_mask
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


@triton.jit
def route_row(
    row_ptr,  # the token's E logits
    t,  # the token's row in the batch (int64)
    weights_ptr,
    ids_ptr,
    slots_ptr,
    log2phy_ptr,
    replicas_ptr,
    counts_ptr,
    slot_counts_ptr,
    num_experts,
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
):
    """One token's routing: the whole row of E logits in registers, k rounds of argmax, its
    pairs' slots and counts. The logits are read past the L1 (another SM may have written them
    in the same kernel)."""
    e = tl.arange(0, BLOCK_E)
    x = tl.load(row_ptr + e, mask=e < num_experts, other=float("-inf"), cache_modifier=".cg")
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
    # One program per token.
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
    route_row(
        logits_ptr + t * stride_l,
        t,
        weights_ptr,
        ids_ptr,
        slots_ptr,
        log2phy_ptr,
        replicas_ptr,
        counts_ptr,
        slot_counts_ptr,
        num_experts,
        stride_phy,
        first_token,
        count_lo,
        count_hi,
        TOP_K,
        RENORMALIZE,
        HAS_TABLE,
        COUNT,
        COUNT_SLOTS,
        BLOCK_E,
        BLOCK_K,
    )


class _RouteArgs(NamedTuple):
    """What `route_row` takes besides the logits, for a launch: `tensors` (weights, ids, slots,
    log2phy, replicas, counts, slot counts: unused ones stand in as `ids`), `scalars` (experts,
    log2phy's stride, first token, counted rows), `flags` (the constexprs)."""

    routing: Routing
    tensors: tuple[torch.Tensor, ...]
    scalars: tuple[int, ...]
    flags: dict[str, int | bool]


def _route_args(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    table: SlotTable | None,
    tally: RouteTally | None,
    device: torch.device,
) -> _RouteArgs:
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    slots = torch.empty_like(ids) if table is not None else ids
    counts = tally.expert_counts if tally is not None else ids
    slot_counts = tally.slot_counts if tally is not None else None
    for name, buf in (("expert", counts), ("slot", slot_counts)):
        if buf is not None and buf.dtype != torch.int64:
            raise ValueError(f"{name} counts must be int64, got {buf.dtype}")
    tensors = (
        weights,
        ids,
        slots,
        table.log2phy if table is not None else ids,
        table.replicas if table is not None else ids,
        counts,
        slot_counts if slot_counts is not None else ids,
    )
    scalars = (
        num_experts,
        table.log2phy.stride(0) if table is not None else 0,
        table.first_token if table is not None else 0,
        tally.lo if tally is not None else 0,
        tally.hi if tally is not None else 0,
    )
    flags = {
        "TOP_K": top_k,
        "RENORMALIZE": renormalize,
        "HAS_TABLE": table is not None,
        "COUNT": tally is not None,
        "COUNT_SLOTS": slot_counts is not None,
        "BLOCK_E": triton.next_power_of_2(num_experts),
        "BLOCK_K": triton.next_power_of_2(top_k),
    }
    return _RouteArgs(Routing(weights, ids, slots), tensors, scalars, flags)


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
    args = _route_args(num_tokens, num_experts, top_k, renormalize, table, tally, device)
    if not num_tokens:
        return args.routing
    logits = last_dim_contiguous(router_logits)
    use_pdl = pdl(device)
    num_experts, stride_phy, *rest = args.scalars
    _route_kernel[(num_tokens,)](
        logits,
        *args.tensors,
        num_experts,
        logits.stride(0),
        stride_phy,
        *rest,
        **args.flags,
        USE_PDL=use_pdl,
        num_warps=4 if args.flags["BLOCK_E"] >= 512 else 1,
        **pdl_launch(use_pdl),
    )
    return args.routing


@triton.jit(do_not_specialize=["first_token", "count_lo", "count_hi"])
def _gate_route_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    arrivals_ptr,
    weights_ptr,
    ids_ptr,
    slots_ptr,
    log2phy_ptr,
    replicas_ptr,
    counts_ptr,
    slot_counts_ptr,
    num_experts,
    stride_phy,
    first_token,
    count_lo,
    count_hi,
    M,
    K,
    stride_xm,
    stride_wn,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_SLOTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Programs over the experts, BLOCK_N each: logits [M, E] = x [M, K] @ W[E, K]^T as the GEMV
    # computes a projection (rounded to x's dtype, then fp32); the last program to finish routes
    # every token.
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_H)
    row_ok = rows < M
    w_rows = tl.minimum(cols, num_experts - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_H]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_H]
    k_ok = ks < K
    w = load_weight_tile(w_ptrs, k_ok, EVEN_H)
    wait_for_previous(USE_PDL)
    x = load_x_tile(x_ptrs, x_tile_mask(row_ok, k_ok, EVEN_H), K, False)
    acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    for k0 in range(BLOCK_H, K, BLOCK_H):
        w_ptrs += BLOCK_H
        x_ptrs += BLOCK_H
        k_ok = (k0 + ks) < K
        w = load_weight_tile(w_ptrs, k_ok, EVEN_H)
        x = load_x_tile(x_ptrs, x_tile_mask(row_ok, k_ok, EVEN_H), K, False)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    out = logits_ptr + rows[:, None] * num_experts + cols[None, :]
    tl.store(out, y, mask=row_ok[:, None] & (cols < num_experts)[None, :])
    if last_to_arrive(arrivals_ptr, tl.num_programs(0)):
        for t in range(M):
            route_row(
                logits_ptr + t * num_experts,
                t,
                weights_ptr,
                ids_ptr,
                slots_ptr,
                log2phy_ptr,
                replicas_ptr,
                counts_ptr,
                slot_counts_ptr,
                num_experts,
                stride_phy,
                first_token,
                count_lo,
                count_hi,
                TOP_K,
                RENORMALIZE,
                HAS_TABLE,
                COUNT,
                COUNT_SLOTS,
                BLOCK_E,
                BLOCK_K,
            )


# The router's launch shape: Qwen3-30B-A3B's [128, 2,048] router in 32 programs of one K tile
# each (the fastest GEMV shape for it on an H100: 1.6 us against 2.1 for the default's).
GATE_BLOCK_N = 4
GATE_BLOCK_H = 2048
GATE_WARPS = 8


@register_triton("moe_gate_route")
def moe_gate_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    table: SlotTable | None = None,
    tally: RouteTally | None = None,
) -> Routing:
    # The contract, shapes included, of `pdmesh.kernels.moe.moe_gate_route`, which calls this.
    # A decode step's few tokens (those the GEMV takes); the rest as the reference does it.
    arrivals = arrival_counters(x.device, 1) if fits(x, gate_weight) else None
    if arrivals is None:
        return moe_gate_route_ref(x, gate_weight, top_k, renormalize, table, tally)
    (num_tokens, hidden), num_experts = x.shape, gate_weight.shape[0]
    args = _route_args(num_tokens, num_experts, top_k, renormalize, table, tally, x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    use_pdl = pdl(x.device)
    block_h = min(GATE_BLOCK_H, triton.next_power_of_2(hidden))
    _gate_route_kernel[(triton.cdiv(num_experts, GATE_BLOCK_N),)](
        x,
        gate_weight,
        logits,
        arrivals,
        *args.tensors,
        *args.scalars,
        num_tokens,
        hidden,
        x.stride(0),
        gate_weight.stride(0),
        **args.flags,
        EVEN_H=hidden % block_h == 0,
        USE_PDL=use_pdl,
        BLOCK_M=triton.next_power_of_2(num_tokens),
        BLOCK_N=GATE_BLOCK_N,
        BLOCK_H=block_h,
        num_warps=GATE_WARPS,
        **pdl_launch(use_pdl),
    )
    return args.routing
