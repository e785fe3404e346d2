"""Paged prefill attention over a varlen batch (flash-attention 2 style, keys read from pages).

One program per (query head, block of BLOCK_M new tokens, sequence). A sequence's new tokens are
the last q_len positions of its context, so a block's keys are everything up to its last token:
a cached prefix, earlier new tokens, then a diagonal band that needs the causal mask. The
unmasked part runs in a loop without masks; only the band pays for them. Heads are the fastest
grid axis, so the programs of one GQA group run side by side and share K/V in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.device import dot_precision, last_dim_contiguous
from pdmesh.kernels.triton.kv_store import cache_strides

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    n0,
    q_pos,
    end,
    table,
    k_cache_ptr,
    v_cache_ptr,
    kv_off,
    d,
    stride_cb,
    stride_cs,
    scale_log2e,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tok = n0 + tl.arange(0, BLOCK_N)
    within = tok % PAGE
    t_mask = tok < end
    if MASKED:
        page = tl.load(table + tok // PAGE, mask=t_mask, other=0).to(tl.int64)
    else:
        page = tl.load(table + tok // PAGE).to(tl.int64)
    # kT: [BLOCK_D, BLOCK_N], loaded transposed for the QK^T product; v: [BLOCK_N, BLOCK_D].
    rows = kv_off + page * stride_cb + within * stride_cs  # [BLOCK_N]
    k_ptrs = k_cache_ptr + rows[None, :] + d[:, None]
    v_ptrs = v_cache_ptr + rows[:, None] + d[None, :]
    d_mask = d < HEAD_DIM
    if MASKED:
        kt = tl.load(k_ptrs, mask=d_mask[:, None] & t_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        kt = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        kt = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    kt = kt.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2e  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# The block tables' width changes from step to step: unspecialized, so that a new width never
# compiles the kernel again mid-serving (see decode_attention.py).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2e,  # the softmax scale x log2(e), times an fp8 cache's K scale
    v_scale,  # an fp8 cache's V scale (1.0 otherwise), applied to the weighted sum
    stride_qt,
    stride_qh,
    stride_cb,  # of k_cache and v_cache, which share one layout
    stride_cs,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    h = tl.program_id(0)
    # The last query blocks see the most keys: launch them first so they do not form the tail.
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # keys before the first new token
    kvh = h // GROUP

    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    q_tok = (q_start + rows).to(tl.int64)
    q_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask)
    q_pos = prefix + rows  # [BLOCK_M]: each query's position in its context

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    kv_off = kvh * stride_ch
    # Keys <= prefix + m0 are visible to every row; the band after needs the mask.
    full_end = (prefix + m0 + 1) // BLOCK_N * BLOCK_N
    end = tl.minimum(ctx, prefix + m0 + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, end, table, k_cache_ptr, v_cache_ptr, kv_off, d,
            stride_cb, stride_cs, scale_log2e,
            HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, False, EVEN_D, DOT_PREC,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, end, table, k_cache_ptr, v_cache_ptr, kv_off, d,
            stride_cb, stride_cs, scale_log2e,
            HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, True, EVEN_D, DOT_PREC,
        )  # fmt: skip

    out = acc / l_i[:, None] * v_scale  # every stored row saw at least its own key: l_i > 0
    o_ptrs = out_ptr + q_tok[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile_sizes(dtype: torch.dtype, head_dim: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). bf16/fp16 on H100: 175 registers, ~100 KB of
    shared memory at head_dim 128, no spills. Exact fp32 dots run on CUDA cores: small tiles."""
    if dtype == torch.float32:
        return 32, 16, 8, 2
    block_m = 64 if max_query_len <= 64 else 128
    return block_m, 64, 8 if head_dim > 64 else 4, 3


@register_triton("paged_prefill_attention")
def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S+1]
    context_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    *,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale: folded into `scale`
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = last_dim_contiguous(query)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m, block_n, num_warps, num_stages = _tile_sizes(query.dtype, head_dim, max_query_len)
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_seqs)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale * LOG2E * k_scale,
        float(v_scale),
        *query.stride()[:2],
        *cache_strides(k_cache, v_cache),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        EVEN_D=head_dim == triton.next_power_of_2(head_dim),
        DOT_PREC=dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
