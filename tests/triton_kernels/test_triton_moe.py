"""Triton MoE routing, expert alignment and fused experts against the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import RouteTally, SlotTable, moe_experts, moe_route
from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
from pdmesh.kernels.triton.moe_align import moe_align_block_size
from pdmesh.kernels.triton.moe_gemv import MAX_TOKENS

Check = Callable[[torch.Tensor, torch.Tensor], None]


@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 1), (8, 2), (60, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_route_matches_reference(
    num_experts: int, top_k: int, renormalize: bool, dtype: torch.dtype, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(num_experts + top_k)
    # Distinct logits, even in bf16, so the top-k order has no ties to break differently.
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(13)])
    logits = ((ranks - num_experts / 2) * (4 / num_experts)).to(device, dtype)

    weights, ids, _ = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids, _ = moe_route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first_token", [0, 5])
def test_moe_route_maps_slots_and_counts_like_the_reference(
    first_token: int, device: torch.device
) -> None:
    # EPLB's tables: 6 experts in 8 slots, experts 1 and 4 twice; rows 2..8 counted.
    num_experts, top_k, num_tokens = 6, 2, 11
    placement = [0, 1, 2, 3, 4, 5, 1, 4]
    log2phy = torch.zeros(num_experts, len(placement), dtype=torch.int64)
    replicas = torch.zeros(num_experts, dtype=torch.int64)
    for slot, e in enumerate(placement):
        log2phy[e, replicas[e]] = slot
        replicas[e] += 1
    g = torch.Generator().manual_seed(first_token)
    ranks = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)])
    logits = (ranks * 0.5).float().to(device)
    table = SlotTable(log2phy.to(device), replicas.to(device), first_token)

    def counted(route) -> tuple:
        # Counters that already hold counts: routing adds to them.
        counts = torch.arange(num_experts, dtype=torch.int64, device=device)
        slot_counts = torch.full((len(placement),), 3, dtype=torch.int64, device=device)
        r = route(logits, top_k, True, table, RouteTally(2, 9, counts, slot_counts))
        return r, counts, slot_counts

    (r, counts, slot_counts), (ref, ref_counts, ref_slot_counts) = (
        counted(moe_route),
        counted(moe_route_ref),
    )
    assert torch.equal(r.ids, ref.ids) and torch.equal(r.slots, ref.slots)
    assert torch.equal(counts, ref_counts) and torch.equal(slot_counts, ref_slot_counts)
    # Every pair went to a slot holding its expert, and the counts grew by the 7 rows' pairs.
    assert torch.equal(torch.tensor(placement, device=device)[r.slots], r.ids)
    assert int(counts.sum()) == sum(range(num_experts)) + 7 * top_k
    assert int(slot_counts.sum()) == 3 * len(placement) + 7 * top_k
    # A replicated expert's tokens alternate between its slots.
    rows, cols = torch.where(r.ids == 1)
    expect = log2phy[1, (rows.cpu() + first_token) % 2].to(device)
    assert torch.equal(r.slots[rows, cols], expect)


def test_moe_route_counts_slots_as_experts_without_a_table(device: torch.device) -> None:
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(3)).to(device)

    def counted(route) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.zeros(6, dtype=torch.int64, device=device)
        slot_counts = torch.zeros(6, dtype=torch.int64, device=device)
        route(logits, 2, True, None, RouteTally(1, 7, counts, slot_counts))
        return counts, slot_counts

    counts, slot_counts = counted(moe_route)
    ref_counts, ref_slot_counts = counted(moe_route_ref)
    assert torch.equal(counts, ref_counts) and torch.equal(slot_counts, ref_slot_counts)
    assert torch.equal(slot_counts, counts) and int(counts.sum()) == 6 * 2


@pytest.mark.parametrize(("first_expert", "block_m"), [(0, 4), (2, 16)])
def test_moe_align_groups_every_held_pair_by_expert(
    first_expert: int, block_m: int, device: torch.device
) -> None:
    num_tokens, top_k, num_local, num_global = 9, 2, 4, 8
    g = torch.Generator().manual_seed(block_m)
    ids = torch.stack([torch.randperm(num_global, generator=g)[:top_k] for _ in range(num_tokens)])
    align = moe_align_block_size(ids.to(device), first_expert, num_local, block_m)

    sorted_ids = align.sorted_ids.cpu()
    expert_ids = align.expert_ids.cpu()
    num_padded = int(align.num_padded)
    flat = ids.flatten() - first_expert
    held = [f for f in range(flat.numel()) if 0 <= flat[f] < num_local]
    per_expert = torch.bincount(flat[held], minlength=num_local)
    assert num_padded == int((-(-per_expert // block_m) * block_m).sum())
    # Every held pair exactly once, in a block labelled with its expert; the rest is padding.
    rows = sorted_ids[:num_padded]
    assert sorted(rows[rows < flat.numel()].tolist()) == held
    assert bool((sorted_ids[num_padded:] == flat.numel()).all())
    for row, pair in enumerate(rows.tolist()):
        if pair < flat.numel():
            assert int(expert_ids[row // block_m]) == int(flat[pair])
    used_blocks = num_padded // block_m
    assert bool((expert_ids[used_blocks:] == -1).all())
    assert expert_ids[:used_blocks].tolist() == sorted(expert_ids[:used_blocks].tolist())


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "top_k", "first_expert"),
    [
        (9, 64, 32, 1, 0),
        (9, 64, 32, 2, 0),
        (9, 72, 40, 2, 2),  # widths off the tile sizes; expert parallel: experts 2..5 here
        (70, 64, 32, 2, 4),  # a larger batch: another tile configuration
        (1, 64, 32, 4, 0),  # decode batches: the GEMV kernels
        (MAX_TOKENS, 72, 40, 3, 2),
        (3, 96, 48, 2, 4),  # experts 4..7 here
    ],
)
def test_moe_experts_matches_reference(
    num_tokens: int,
    hidden: int,
    inter: int,
    top_k: int,
    first_expert: int,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    num_local, num_global = 4, 8
    g = torch.Generator().manual_seed(num_tokens + hidden + top_k)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(num_local, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    logits = torch.randn(num_tokens, num_global, generator=g).to(device)
    weights, ids, _ = moe_route_ref(logits, top_k, renormalize=True)

    out = moe_experts(x, w13, w2, weights, ids, first_expert)
    ref = moe_experts_ref(x, w13, w2, weights, ids, first_expert)
    assert_close(out, ref)


@pytest.mark.parametrize("num_tokens", [3, MAX_TOKENS + 1])  # GEMV kernels, grouped GEMMs
def test_moe_experts_gives_zero_for_tokens_routed_elsewhere(
    num_tokens: int, device: torch.device, assert_close: Check
) -> None:
    # Under expert parallelism a token whose experts all live on other ranks contributes nothing,
    # and so does a pair sent to slot -1 (a padding row's).
    x = torch.randn(num_tokens, 64, device=device)
    w13 = torch.randn(2, 64, 64, device=device)
    w2 = torch.randn(2, 64, 32, device=device)
    ids = torch.tensor([[0, 1], [6, -1], [2, 7]] * 3, device=device)[:num_tokens]
    weights = torch.full((num_tokens, 2), 0.5, device=device)
    out = moe_experts(x, w13, w2, weights, ids, first_expert=2)
    assert bool((out[:2] == 0).all())
    assert bool((out[2] != 0).any())
    assert_close(out, moe_experts_ref(x, w13, w2, weights, ids, 2))
