"""Mixture-of-experts: top-k routing and the expert computation (SwiGLU experts).

Expert weights are stacked: w13: [E, 2I, H] (gate rows then up rows), w2: [E, H, I]. Under
expert parallelism a rank holds experts [first_expert, first_expert + E_local); routed ids are
global and ids outside that range are skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdmesh.kernels.backend import pick
from pdmesh.kernels.fp8 import dequantize_rows


class SlotTable(NamedTuple):
    """Logical experts -> physical slots under EPLB (pdmesh.engine.layers.expert_map): expert e
    has replicas[e] slots, log2phy[e, 0 .. replicas[e] - 1]; the pair of batch row r goes to
    replica (first_token + r) % replicas[e], so a hot expert's tokens split evenly and the same
    batch always dispatches the same way."""

    log2phy: torch.Tensor  # [E, P] int64
    replicas: torch.Tensor  # [E] int64
    first_token: int  # the batch index of logits row 0


class RouteTally(NamedTuple):
    """Routed pairs to count as they are routed (load statistics, EPLB): those of rows
    [lo, hi) of the logits (under expert parallelism each rank counts its own share, so the
    ranks' counts summed count every pair once) are added to `expert_counts` ([E] int64) and,
    with a slot table, to `slot_counts` ([P] int64), in place."""

    lo: int
    hi: int
    expert_counts: torch.Tensor
    slot_counts: torch.Tensor | None = None


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int64 logical experts
    slots: torch.Tensor  # [T, k] int64 physical slots (`ids` itself without a slot table)


def moe_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    table: SlotTable | None = None,
    tally: RouteTally | None = None,
) -> Routing:
    """Softmax, top-k (renormalised), each pair's physical slot and the counts, in one kernel
    on GPUs: at decode batch sizes every one of these is a launch of ~2 us for nanoseconds of
    work, and a step runs them once per MoE layer."""
    fn = pick("moe_route", router_logits, moe_route_ref)
    return fn(router_logits, top_k, renormalize, table, tally)


def moe_route_ref(router_logits, top_k, renormalize, table=None, tally=None):
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    slots = ids
    if table is not None:
        row = torch.arange(ids.shape[0], device=ids.device) + table.first_token
        slots = table.log2phy[ids, row[:, None] % table.replicas[ids]]
    if tally is not None:
        _count(tally.expert_counts, ids[tally.lo : tally.hi])
        if tally.slot_counts is not None:
            _count(tally.slot_counts, slots[tally.lo : tally.hi])
    return Routing(weights, ids, slots)


def _count(counts: torch.Tensor, ids: torch.Tensor) -> None:
    # scatter_add, not bincount: bincount reads its input's max on the host, which a CUDA graph
    # capture does not allow.
    flat = ids.flatten()
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))


def moe_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    first_expert: int = 0,
    w13_scale: torch.Tensor | None = None,  # [E_local, 2I] float32: w13 is fp8
    w2_scale: torch.Tensor | None = None,  # [E_local, H] float32: w2 is fp8
) -> torch.Tensor:  # [T, H]: sum over each token's experts held here of weight * expert(x)
    """With scales, the weights are fp8 (row r of w13[e] is w13[e, r] * w13_scale[e, r]) and
    the activations stay in x's dtype (weight-only FP8)."""
    fn = pick("moe_experts", x, moe_experts_ref)
    return fn(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale)


# A CPU GEMM of fewer rows (or a count not a multiple of this) takes another code path whose
# sums round differently (measured: fp32, 1..7 rows vs 8+), so a row's result would depend on how
# many rows share its expert, which EPLB's replicas change. Each expert's rows are zero-padded to
# a multiple of this: a row's result is then the same whatever else is batched with it.
_ROW_MULTIPLE = 8


def _linear_batch_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # x: [M, K], w: [N, K] -> [M, N]
    pad = -x.shape[0] % _ROW_MULTIPLE
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return F.linear(x, w)[: x.shape[0] - pad]


def moe_experts_ref(
    x, w13, w2, topk_weights, topk_ids, first_expert=0, w13_scale=None, w2_scale=None
):
    out = torch.zeros_like(x)
    local_ids = topk_ids - first_expert
    # Experts in ascending order, each over the tokens routed to it: the order Hugging Face uses,
    # so float sums round the same way.
    for e in torch.unique(local_ids).tolist():
        if e < 0 or e >= w13.shape[0]:
            continue
        token_idx, slot = torch.where(local_ids == e)
        w13_e, w2_e = w13[e], w2[e]
        if w13_scale is not None:  # fp8: dequantized to the activations' dtype
            w13_e = dequantize_rows(w13_e, w13_scale[e], x.dtype)
            w2_e = dequantize_rows(w2_e, w2_scale[e], x.dtype)
        gate, up = _linear_batch_invariant(x[token_idx], w13_e).chunk(2, dim=-1)
        h = _linear_batch_invariant(F.silu(gate) * up, w2_e)
        h = h * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out
