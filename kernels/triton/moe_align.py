"""Grouping a batch's (token, slot) pairs by expert for the grouped GEMMs ("moe_align_block_size").

Every routed pair is a flat index f = token * top_k + slot. The pairs of local expert e are laid
out contiguously, each expert's run padded to a multiple of BLOCK_M, experts in ascending order:

    sorted_ids:   [max_padded] int32, a flat index per row, `num_pairs` for padding rows
    expert_ids:   [max_blocks] int32, the local expert of each BLOCK_M rows, -1 past the end
    num_padded:   [1] int32, rows in use

Pairs routed outside [first_expert, first_expert + E_local) are left out. Three small kernels,
no host synchronisation: a histogram (atomics), a scan over experts that also labels each block,
and a scatter in which an atomic counter per expert hands out rows. The order of pairs inside an
expert's run depends on the atomics; it does not change any result, as every row of a GEMM is
computed independently of the others.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_BLOCK_B = 64


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32
    expert_ids: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    max_blocks: int  # grid bound for the GEMMs (rows actually used: num_padded)


# The pair count and grid bound change with the batch: specialising on their values (1, or
# multiples of 16) would compile new variants in the middle of a run.
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, first_expert, num_local, BLOCK: tl.constexpr):
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + f, mask=f < num_pairs, other=-1).to(tl.int32) - first_expert
    keep = (f < num_pairs) & (e >= 0) & (e < num_local)
    tl.atomic_add(counts_ptr + e, 1, mask=keep)


@triton.jit(do_not_specialize=["max_blocks"])
def _scan_kernel(
    counts_ptr,
    cursor_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_local,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # A single program: padded run lengths, their starts (the scatter's counters), block labels.
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_local
    counts = tl.load(counts_ptr + e, mask=e_mask, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [BLOCK_E]
    tl.store(cursor_ptr + e, ends - padded, mask=e_mask)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    ends = tl.where(e_mask, ends, total + 1)  # padded experts never count below
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        first_row = b * BLOCK_M
        # The expert owning a row is the number of runs that end at or before it.
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(expert_ids_ptr + b, owner, mask=b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    ids_ptr, cursor_ptr, sorted_ids_ptr, num_pairs, first_expert, num_local, BLOCK: tl.constexpr
):
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + f, mask=f < num_pairs, other=-1).to(tl.int32) - first_expert
    keep = (f < num_pairs) & (e >= 0) & (e < num_local)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=keep)
    tl.store(sorted_ids_ptr + row, f, mask=keep)


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    first_expert: int,
    num_local_experts: int,
    block_m: int,
) -> MoEAlignment:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    # At most min(E, pairs) experts are hit, each wasting < block_m rows of padding.
    max_padded = num_pairs + min(num_local_experts, num_pairs) * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    counts = torch.zeros(num_local_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    grid = (triton.cdiv(max(num_pairs, 1), _BLOCK),)
    _count_kernel[grid](ids, counts, num_pairs, first_expert, num_local_experts, BLOCK=_BLOCK)
    _scan_kernel[(1,)](
        counts,
        cursor,
        expert_ids,
        num_padded,
        num_local_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_local_experts),
        BLOCK_B=_BLOCK_B,
    )
    _scatter_kernel[grid](
        ids, cursor, sorted_ids, num_pairs, first_expert, num_local_experts, BLOCK=_BLOCK
    )
    return MoEAlignment(sorted_ids, expert_ids, num_padded, max_blocks)
