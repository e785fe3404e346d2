"""Paged attention on the CPU. Decode: fp32 caches go to the Numba kernel (`paged_decode.py`),
which reads the pages in place; other dtypes (bf16, fp16) to SDPA: sequences in groups of similar
context length, each group's pages gathered once and attended with its query heads folded onto
their KV heads. Prefill: sequences with a few new tokens (FEW_QUERIES) go to the same Numba
kernel, the others to the reference.

Two things make the reference (`kernels/attention.py`, written to be obviously right) slow here:
SDPA with `enable_gqa` expands every KV head to its query heads before the product, and groups of
8 pad more sequences to a longer context. Folding the G query heads of a KV head into SDPA's query
axis ([b, Hkv, G, D] against keys [b, Hkv, L, D]) reads each key once for all of them, and groups
of 4 pad less. The grouping, the page tables and the masks depend only on the step, so they are
made once per step and reused by every layer (the same `block_tables` tensor comes back).
On this project's 2-core build machine, at 16 sequences of 40-760 tokens of the default model:
about 3x less time than the reference over 30 layers (BENCHMARKS.md, the CPU section).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdmesh.kernels.attention import gather_pages, paged_prefill_attention_ref
from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.cpu import paged_decode
from pdmesh.kernels.kv_quant import dequantize, is_fp8

GROUP = 4  # sequences per gather: measured best of 1, 2, 4 and 8 at batches 6 and 16
# Prefills of at most this many tokens (a speculative verify step's k + 1, a short continuation
# of a cached prompt) go to the Numba kernel; longer ones to the reference, whose SDPA runs them
# as matrix products.
FEW_QUERIES = 16


@dataclass(frozen=True)
class _Group:
    rows: torch.Tensor  # [b] int64: the group's sequences in the batch
    tables: torch.Tensor  # [b, nb] int64: their pages, up to the group's longest context
    length: int  # that longest context
    mask: torch.Tensor | None  # [b, 1, 1, length] bool; None when every context is `length`


@dataclass(frozen=True)
class _Plan:
    tables: weakref.ref[torch.Tensor]
    lens: weakref.ref[torch.Tensor]
    sizes: list[int]
    block_size: int
    groups: tuple[_Group, ...]

    def serves(self, tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> bool:
        # Weak references: a later step's tensors never match a freed one's plan. Each step's
        # metadata is made afresh (engine/runner/step_inputs.py; buffers refilled in place are CUDA
        # graphs', which never come here), and the lengths are compared as well.
        return (
            self.tables() is tables
            and self.lens() is lens
            and self.block_size == block_size
            and lens.tolist() == self.sizes
        )


_last: _Plan | None = None


def _plan(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> _Plan:
    global _last
    last = _last
    if last is not None and last.serves(tables, lens, block_size):
        return last
    sizes = lens.tolist()
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    groups = []
    for start in range(0, len(order), GROUP):
        rows = order[start : start + GROUP]
        length = sizes[rows[-1]]
        idx = torch.tensor(rows)
        mask = None
        if sizes[rows[0]] != length:
            mask = torch.arange(length).unsqueeze(0) < lens[idx].unsqueeze(1)
            mask = mask.view(len(rows), 1, 1, length)
        pages = tables.index_select(0, idx)[:, : -(-length // block_size)].long()
        groups.append(_Group(idx, pages, length, mask))
    plan = _Plan(weakref.ref(tables), weakref.ref(lens), sizes, block_size, tuple(groups))
    _last = plan
    return plan


@register_cpu("paged_decode_attention")
def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    max_context_len: int | None = None,
    *,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D]
    if paged_decode.fits(query, k_cache, v_cache):  # fp32: read in place, no gathered copy
        return paged_decode.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale
        )
    args = (query, k_cache, v_cache, block_tables, context_lens, scale)
    return grouped_sdpa_decode(*args, k_scale, v_scale)


def grouped_sdpa_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The SDPA path (the module's docstring), for any dtype; an fp8 cache's pages are
    dequantized as they are gathered, a group at a time."""
    heads, dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    for g in _plan(block_tables, context_lens, k_cache.shape[1]).groups:
        b = g.rows.numel()
        # [b, nb, BS, Hkv, D] -> [b, Hkv, L, D]
        keys = gather_pages(k_cache, g.tables).flatten(1, 2)[:, : g.length].transpose(1, 2)
        values = gather_pages(v_cache, g.tables).flatten(1, 2)[:, : g.length].transpose(1, 2)
        q = query.index_select(0, g.rows).view(b, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(
            q,
            dequantize(keys, query.dtype, k_scale),
            dequantize(values, query.dtype, v_scale),
            attn_mask=g.mask,
            scale=scale,
        )  # [b, Hkv, G, D]
        out.index_copy_(0, g.rows, o.reshape(b, heads, dim))
    return out


@register_cpu("paged_prefill_attention")
def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S+1]
    context_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    *length_hints: int | None,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Sequences with at most FEW_QUERIES new tokens: the Numba kernel, reading their pages in
    place; the others (and other dtypes, fp8 caches among them): the reference, as a batch of
    their own."""
    args = (cu_seqlens_q, context_lens, block_tables, scale)
    if not paged_decode.fits(query, k_cache, v_cache):
        scales = {"k_scale": k_scale, "v_scale": v_scale} if is_fp8(k_cache.dtype) else {}
        return paged_prefill_attention_ref(query, k_cache, v_cache, *args, **scales)
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    few = [i for i, n in enumerate(q_lens) if n <= FEW_QUERIES]
    if not few:
        return paged_prefill_attention_ref(query, k_cache, v_cache, *args)
    rows, seqs, visible = [], [], []
    for i in few:  # query j of n sits at position ctx - n + j and sees keys up to it
        n, ctx = q_lens[i], lens[i]
        rows += range(starts[i], starts[i + 1])
        seqs += [i] * n
        visible += range(ctx - n + 1, ctx + 1)
    out = torch.empty(query.shape, dtype=query.dtype)
    tensors = (torch.tensor(rows), torch.tensor(seqs), torch.tensor(visible))
    paged_decode.attend(query, k_cache, v_cache, block_tables, *tensors, scale, out)
    rest = [i for i, n in enumerate(q_lens) if n > FEW_QUERIES]
    if rest:
        idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest])
        sizes = torch.tensor([0] + [q_lens[i] for i in rest])
        picked = torch.tensor(rest)
        out[idx] = paged_prefill_attention_ref(
            query[idx],
            k_cache,
            v_cache,
            sizes.cumsum(0),
            context_lens[picked],
            block_tables[picked],
            scale,
        )
    return out
