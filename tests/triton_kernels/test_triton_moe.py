"""Triton MoE routing, expert alignment and fused experts against the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import moe_experts, moe_route
from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
from pdmesh.kernels.triton.moe_align import moe_align_block_size

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

    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


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
    weights, ids = moe_route_ref(logits, top_k, renormalize=True)

    out = moe_experts(x, w13, w2, weights, ids, first_expert)
    ref = moe_experts_ref(x, w13, w2, weights, ids, first_expert)
    assert_close(out, ref)


def test_moe_experts_gives_zero_for_tokens_routed_elsewhere(device: torch.device) -> None:
    # Under expert parallelism a token whose experts all live on other ranks contributes nothing.
    x = torch.randn(3, 64, device=device)
    w13 = torch.randn(2, 64, 64, device=device)
    w2 = torch.randn(2, 64, 32, device=device)
    ids = torch.tensor([[0, 1], [6, 7], [2, 7]], device=device)
    weights = torch.full((3, 2), 0.5, device=device)
    out = moe_experts(x, w13, w2, weights, ids, first_expert=2)
    assert bool((out[:2] == 0).all())
    assert bool((out[2] != 0).any())
