"""Moving an MoE layer's expert weights to a new placement, over its expert-parallel group.

Every rank calls `move_experts` with the same new placement at the same step boundary and
derives the same plan from the old and new placements: a slot whose expert this rank already
holds copies it locally; any other is received from a rank that holds it (one all-to-all of
whole experts, raw tensors, no pickle). Weights are overwritten in place, so tensors keep their
addresses (CUDA graphs and anything else holding them stay valid).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdmesh.engine.layers.moe import FusedMoE


def _sources(
    old: Sequence[int], new: Sequence[int], per_rank: int, rank: int
) -> list[tuple[int, int]]:
    """For each of `rank`'s new slots: (source rank, source local slot) in the old placement."""
    holders: dict[int, list[int]] = {}
    for slot, e in enumerate(old):
        holders.setdefault(e, []).append(slot // per_rank)
    plan = []
    mine_before = list(old[rank * per_rank : (rank + 1) * per_rank])
    for e in new[rank * per_rank : (rank + 1) * per_rank]:
        if e in mine_before:
            src = rank
        else:  # spread the senders of a replicated expert over its holders
            ranks = sorted(set(holders[e]))
            src = ranks[rank % len(ranks)]
        plan.append((src, list(old[src * per_rank : (src + 1) * per_rank]).index(e)))
    return plan


def _rows(w13: torch.Tensor, w2: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Copies of whole experts: slots' w13 [2I, H] and w2 [H, I] flattened -> [n, D]."""
    idx = torch.tensor(slots, dtype=torch.int64, device=w13.device)
    return torch.cat((w13[idx].flatten(1), w2[idx].flatten(1)), dim=1)


def move_experts(moe: FusedMoE, new: Sequence[int]) -> None:
    """Switch `moe` to placement `new` ([P] the logical expert of each slot). Only slots whose
    expert changes are written."""
    assert moe.experts is not None
    g, per_rank = moe.tp, moe.num_local_experts
    old = moe.experts.placement()
    if tuple(new) == old:
        return
    me = g.rank
    plans = [_sources(old, new, per_rank, r) for r in range(g.size)]
    # Rows each rank sends to each other rank, and receives from it.
    send = [0 if r == me else sum(s == me for s, _ in plans[r]) for r in range(g.size)]
    recv = [0 if r == me else sum(s == r for s, _ in plans[me]) for r in range(g.size)]
    remote = any(src != r for r, plan in enumerate(plans) for src, _ in plan)
    w13, w2 = moe.w13_weight.data, moe.w2_weight.data  # [S, 2I, H], [S, H, I]
    base = me * per_rank
    changed = [j for j in range(per_rank) if new[base + j] != old[base + j]]
    # Local copies are read before any slot is overwritten.
    local = [(j, plans[me][j][1]) for j in changed if plans[me][j][0] == me]
    local_rows = _rows(w13, w2, [slot for _, slot in local]) if local else None
    received = None
    if remote:  # every rank decides this alike: all or none enter the collective
        # Rows to each rank in its slot order; rows from each rank arrive in ours.
        send_slots = [slot for r in range(g.size) if r != me for s, slot in plans[r] if s == me]
        rows = _rows(w13, w2, send_slots) if send_slots else w13.new_empty(0, _width(w13, w2))
        received = g.all_to_all(rows, send, recv)  # [sum(recv), D]
    dst, src_rows = [j for j, _ in local], [local_rows] if local_rows is not None else []
    if received is not None and received.shape[0]:
        # Received rows come grouped by source rank, each group in our slot order.
        first = [sum(recv[:r]) for r in range(g.size)]
        taken = [0] * g.size
        order = []
        for j in changed:
            src = plans[me][j][0]
            if src != me:
                dst.append(j)
                order.append(first[src] + taken[src])
                taken[src] += 1
        src_rows.append(received[torch.tensor(order, device=received.device)])
    if dst:
        rows = torch.cat(src_rows)
        idx = torch.tensor(dst, dtype=torch.int64, device=w13.device)
        split = w13[0].numel()
        w13[idx] = rows[:, :split].view(-1, *w13.shape[1:])
        w2[idx] = rows[:, split:].view(-1, *w2.shape[1:])
    moe.experts.set(new)


def _width(w13: torch.Tensor, w2: torch.Tensor) -> int:
    return w13[0].numel() + w2[0].numel()
