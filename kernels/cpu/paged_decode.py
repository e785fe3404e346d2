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


@njit_cached(fastmath=True, boundscheck=False)
def _attend_one(q, k_cache, v_cache, tables, r, b, length, scale, out):  # pragma: no cover
    # Row `r` of q / out ([T, H, D]) attends the first `length` keys of sequence `b` (its pages:
    # tables[b]; caches [NB, BS, Hkv, D]).
    heads, dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
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
        inv = np.float32(1.0) / total  # total 0 (non-finite scores): inf, no error (jit.py)
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


@njit_cached(parallel=True, fastmath=True, boundscheck=False)
def _decode_parallel(q, k_cache, v_cache, tables, lens, scale, out):  # pragma: no cover
    # Row b attends the first lens[b] keys of sequence b.
    for b in prange(lens.shape[0]):
        _attend_one(q, k_cache, v_cache, tables, b, b, lens[b], scale, out)


@njit_cached(parallel=True, fastmath=True, boundscheck=False)
def _attend_parallel(
    q, k_cache, v_cache, tables, rows, seqs, visible, scale, out
):  # pragma: no cover
    # One job per query token j: row rows[j] attends the first visible[j] keys of seqs[j].
    for j in prange(rows.shape[0]):
        _attend_one(q, k_cache, v_cache, tables, rows[j], seqs[j], visible[j], scale, out)


def fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp32, and caches laid out as allocated (a copy of a whole cache would cost more than the
    kernel saves)."""
    return (
        query.dtype is k_cache.dtype is v_cache.dtype is torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _int32(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.int32).contiguous().numpy()


def _arrays(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[np.ndarray, ...]:
    """The kernels' views of a call's query, caches and page tables (copies only of a
    non-contiguous query or tables of another dtype)."""
    return query.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), _int32(block_tables)


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
    caches = _arrays(query, k_cache, v_cache, block_tables)
    jobs = (_int32(rows), _int32(seqs), _int32(visible))
    if rows.shape[0] == 1:  # one job: no pool to start
        (r,), (b,), (length,) = jobs
        _attend_one(*caches, r, b, length, np.float32(scale), out.numpy())
    else:
        _attend_parallel(*caches, *jobs, np.float32(scale), out.numpy())


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] (`fits`)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B], each at least 1
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Row b attends the first context_lens[b] keys of sequence b. Called by every layer of a
    decode step: the inputs are used as they come (int32 tables and lengths from the runner)."""
    out = torch.empty(query.shape, dtype=query.dtype)
    caches = _arrays(query, k_cache, v_cache, block_tables)
    lens, o = _int32(context_lens), out.numpy()
    if query.shape[0] == 1:  # batch 1: no pool to start, in each of the step's layers
        _attend_one(*caches, 0, 0, lens[0], np.float32(scale), o)
    else:
        _decode_parallel(*caches, lens, np.float32(scale), o)
    return out
