"""Paged attention of a few query tokens per sequence on the CPU, compiled by Numba: each key and
value is read from its page, with no gathered copy. Decode steps (one query per sequence) use it,
and so do prefills of a few tokens over a longer context (a speculative verify step, a short
continuation of a cached prompt; `attention.paged_prefill_attention`).

Torch has no paged attention for the CPU: its kernels want each sequence's keys in one tensor,
so the SDPA path (`attention.py`) first gathers every page of the batch into a copy, then reads
the copy again, moving each byte three times. Here one loop per query token reads its
sequence's pages in place: scores for every query head against each key row, a softmax per head,
then the values weighted by it. On the 2-core Xeon build machine, at 16 sequences of 40-760
tokens of the default model's shape, one layer took 0.5 ms against 1.2 ms for the SDPA path
(BENCHMARKS.md, the CPU section).

fp32 only (the model's dtype on the CPU). `fastmath` lets the compiler reorder the sums so they
vectorize: results differ from SDPA's in the last bits. The compiled code is cached on disk
where that is writable (`jit.py`), so a new process loads it instead of compiling it (about 2 s).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from pdmesh.kernels.cpu.jit import njit_cached


@njit_cached(parallel=True, fastmath=True, boundscheck=False)
def _attend(q, k_cache, v_cache, tables, rows, seqs, visible, scale, out):  # pragma: no cover
    # One job per query token: row `rows[j]` of q / out ([T, H, D]) attends the first
    # `visible[j]` keys of sequence `seqs[j]` (its pages: tables[seqs[j]]; caches [NB, BS, Hkv, D]).
    heads, dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    for j in prange(rows.shape[0]):
        r, b, length = rows[j], seqs[j], visible[j]
        scores = np.empty((heads, length), np.float32)
        for t in range(length):
            page, row = tables[b, t // block_size], t % block_size
            for h in range(heads):
                kv = h // group
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += q[r, h, d] * k_cache[page, row, kv, d]
                scores[h, t] = acc * scale
        for h in range(heads):
            top = scores[h, 0]
            for t in range(1, length):
                top = max(top, scores[h, t])
            total = np.float32(0.0)
            for t in range(length):
                e = np.exp(scores[h, t] - top)
                scores[h, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(length):
                scores[h, t] *= inv
        acc = np.zeros((heads, dim), np.float32)
        for t in range(length):
            page, row = tables[b, t // block_size], t % block_size
            for h in range(heads):
                kv = h // group
                p = scores[h, t]
                for d in range(dim):
                    acc[h, d] += p * v_cache[page, row, kv, d]
        for h in range(heads):
            for d in range(dim):
                out[r, h, d] = acc[h, d]


def fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp32, and caches laid out as allocated (a copy of a whole cache would cost more than the
    kernel saves)."""
    return (
        query.dtype is k_cache.dtype is v_cache.dtype is torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def attend(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] (`fits`)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    rows: torch.Tensor,  # [J]: the query rows to compute
    seqs: torch.Tensor,  # [J]: each one's sequence (its row of block_tables)
    visible: torch.Tensor,  # [J]: how many of its sequence's keys it sees, at least 1
    scale: float,
    out: torch.Tensor,  # [T, H, D]: rows `rows` are written
) -> None:
    _attend(
        query.contiguous().numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        block_tables.to(torch.int32).contiguous().numpy(),
        rows.to(torch.int32).numpy(),
        seqs.to(torch.int32).numpy(),
        visible.to(torch.int32).contiguous().numpy(),
        np.float32(scale),
        out.numpy(),
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] (`fits`)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B], each at least 1
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    out = torch.empty(query.shape, dtype=query.dtype)
    every = torch.arange(query.shape[0], dtype=torch.int32)
    attend(query, k_cache, v_cache, block_tables, every, every, context_lens, scale, out)
    return out
