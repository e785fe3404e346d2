"""Paged decode attention, flash-decoding style.

One program per (sequence, KV head, split): it holds all the query heads that share the KV head
(GQA), so each page of K/V is read from memory once, and runs an online softmax over its part of
the context. With one split it writes the output directly; with several, each writes a partial
output and its log-sum-exp, and a second kernel merges the splits. The number of splits is chosen
so that (sequences x KV heads x splits) fills the GPU when the batch alone does not.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import dot_precision, last_dim_contiguous, num_sms
from pdmesh.kernels.triton.kv_store import cache_strides
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous

# A split shorter than this costs more in its partial write and merge than it gains.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
MERGE_BLOCK_S = triton.next_power_of_2(MAX_SPLITS)
# Programs per SM wanted in flight: decode is bound by memory latency, so more than one.
PROGRAMS_PER_SM = 4
LOG2E = 1.4426950408889634


# Triton compiles a kernel again for each new pattern of its integer arguments (equal to 1, a
# multiple of 16, neither). The split count and the block tables' width change from step to step
# (a mixed step's tables are as wide as its longest context), so they are left unspecialized: a
# compile mid-serving held rank 0's host (and its GIL) for 0.5-0.7 s on an H100, and with
# pipeline stages every rank waited (bench/results/pp2-h100x2-2026-11-28b.json).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2e,  # the softmax scale x log2(e), times an fp8 cache's K scale
    v_scale,  # an fp8 cache's V scale (1.0 otherwise), applied to the weighted sum
    num_splits,
    stride_qb,
    stride_qh,
    stride_cb,  # of k_cache and v_cache, which share one layout
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    F16_DOT: tl.constexpr,  # the dots in fp16 (fp8 pages convert to it natively), else q's
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    wait_for_previous(USE_PDL)
    ctx = tl.load(context_lens_ptr + b)
    # Each sequence is cut into num_splits pieces of its own length (a multiple of BLOCK_N).
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gd_mask)
    # q: [BLOCK_G, BLOCK_D]; padded head rows are zeros and never stored.
    if F16_DOT:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_bt
    d_mask = d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        page = tl.load(table + tok // PAGE, mask=t_mask, other=0).to(tl.int64)
        within = tok % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        rows = page * stride_cb + within * stride_cs + kvh * stride_ch  # [BLOCK_N]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # k, v: [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale_log2e
        s = tl.where(t_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    # An empty split (short sequence) has l_i == 0: it writes zeros and lse = -inf (weight 0).
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale  # exact when v_scale is 1
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if DIRECT:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        tl.store(o_ptrs + split * stride_os, out, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (sequence, query head): weight each split by exp2(lse - max lse).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    wait_for_previous(USE_PDL)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a zero-length context: all weights 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    parts = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, no split under MIN_SPLIT_TOKENS,
    and one where two would do: the batch alone then gives at least half the programs wanted
    an SM, and a second split's partial writes and merge cost more than the wave it adds (an
    H100, the 8B shape at batch 64 x 1,024-token contexts: 7.49 -> 7.05 ms a step with fp8
    weights and KV, 9.28 -> 8.92 bf16; at batch 32 x 7,000, three splits against two: 10.4
    against 12.0 ms)."""
    programs = batch * num_kv_heads
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count / max(programs, 1))
    if wanted <= 2:
        return 1
    by_length = max(1, max_context_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


class DecodeTile(NamedTuple):
    """How the split kernel walks the context: tokens a step (`block_n`), pipeline stages,
    warps, and whether its dots run in fp16 (`f16_dot`)."""

    block_n: int
    num_stages: int
    num_warps: int = 4
    f16_dot: bool = False


def default_tile(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> DecodeTile:
    if query_dtype == torch.float32:  # tl.dot on CUDA cores: small tiles, no spills
        return DecodeTile(16, 2)
    if cache_dtype.itemsize == 1:
        # fp8 pages: e4m3 converts to fp16 in one instruction (to bf16 it takes several), and
        # a page's K and V stay below 448 in magnitude, well inside fp16's range (a query
        # beyond it, 65,504, would not: none is in the models served). 128 tokens a step keep
        # as many bytes in flight as bf16's 64. Swept on an H100 (bench/decode_tiles.py, batch
        # 32 x 8,192): 244 us, against 295 with bf16 dots and 64 tokens, 389 over bf16 pages.
        return DecodeTile(128, 3, f16_dot=True)
    return DecodeTile(64, 3)


@register_triton("paged_decode_attention")
def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    *,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale: folded into `scale`
    v_scale: float = 1.0,
    tile: DecodeTile | None = None,  # None: `default_tile`'s (a benchmark sweeps others)
) -> torch.Tensor:  # [B, H, D]
    batch, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    query = last_dim_contiguous(query)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        sm_count = num_sms(query.device)
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, sm_count)
    wide = query.element_size() > 2
    tile = tile or default_tile(query.dtype, k_cache.dtype)
    direct = num_splits == 1
    if direct:
        part, lse = out, out  # lse is unused when writing directly
    else:
        # Partials in fp32: [B, H, S, D] outputs and [B, H, S] log2-sum-exps.
        part = torch.empty(batch, num_heads, num_splits, head_dim, device=query.device)
        lse = torch.empty(batch, num_heads, num_splits, device=query.device)
    use_pdl = pdl(query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part,
        lse,
        scale * LOG2E * k_scale,
        float(v_scale),
        num_splits,
        *query.stride()[:2],
        *cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2) if not direct else 0,
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        DIRECT=direct,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tile.block_n,
        DOT_PREC=dot_precision(query.dtype),
        F16_DOT=tile.f16_dot and not wide,
        USE_PDL=use_pdl,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_launch(use_pdl),
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            part,
            lse,
            out,
            num_splits,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=MERGE_BLOCK_S,  # one size for every split count: one compile
            BLOCK_D=triton.next_power_of_2(head_dim),
            USE_PDL=use_pdl,
            num_warps=4,
            **pdl_launch(use_pdl),
        )
    return out
