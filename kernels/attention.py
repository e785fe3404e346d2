"""Paged attention and the KV-cache store.

Cache layout, per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
Token slot s lives at block s // block_size, offset s % block_size. A batch is flat: prefill
chunks and decodes side by side, each sequence's keys read from its block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdmesh.kernels.backend import pick
from pdmesh.kernels.kv_quant import dequantize, is_fp8, quantize


def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 skips the token (padding)
    k_scale: float = 1.0,  # an fp8 cache stores key / k_scale (kernels/kv_quant.py)
    v_scale: float = 1.0,
) -> None:
    fn = pick("store_kv_cache", key, store_kv_cache_ref)
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def store_kv_cache_ref(
    key, value, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    key = quantize(key, k_cache.dtype, k_scale)
    value = quantize(value, v_cache.dtype, v_scale)
    if is_fp8(k_cache.dtype):  # torch's CPU index_copy_ has no fp8: the same bytes as uint8
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [B]: keys per sequence, the query's own included
    scale: float,
    max_context_len: int | None = None,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale (kernels/kv_quant.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D]
    fn = pick("paged_decode_attention", query, paged_decode_attention_ref)
    args = (query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
    return fn(*args, k_scale=k_scale, v_scale=v_scale)


def gather_pages(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache[tables] (pages [NB, BS, Hkv, D] picked by a table of any shape), gathered as whole
    pages: index_select copies each page as one run of bytes, several times faster on the CPU
    than advanced indexing, which moves element by element."""
    picked = cache.index_select(0, tables.reshape(-1))
    return picked.view(*tables.shape, *cache.shape[1:])


# Decode batches larger than this are split into groups of sequences of similar context length:
# each group gathers and attends over its own longest context instead of the batch's, which on
# the CPU (where this reference is the kernel) roughly halves the bytes moved for mixed lengths.
DECODE_GROUP = 8


def paged_decode_attention_ref(
    query,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    max_context_len=None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    batch = query.shape[0]
    scales = (k_scale, v_scale)
    if batch > DECODE_GROUP and not query.is_cuda:
        lens = context_lens.tolist()
        order = sorted(range(batch), key=lens.__getitem__)
        out = torch.empty_like(query)
        for start in range(0, batch, DECODE_GROUP):
            rows = order[start : start + DECODE_GROUP]
            idx = torch.tensor(rows, device=query.device)
            out[idx] = _decode_attention(
                query[idx],
                k_cache,
                v_cache,
                block_tables[idx],
                context_lens[idx],
                scale,
                lens[rows[-1]],
                scales,
            )
        return out
    return _decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, scales
    )


def _decode_attention(
    query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, scales
):
    block_size = k_cache.shape[1]
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    batch = query.shape[0]
    # Gather each sequence's pages: [B, nb, BS, Hkv, D] -> [B, Hkv, L, D]
    keys = gather_pages(k_cache, tables).flatten(1, 2)[:, :max_context_len].transpose(1, 2)
    values = gather_pages(v_cache, tables).flatten(1, 2)[:, :max_context_len].transpose(1, 2)
    positions = torch.arange(max_context_len, device=query.device)
    mask = (positions.unsqueeze(0) < context_lens.unsqueeze(1)).view(batch, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        dequantize(keys, query.dtype, scales[0]),
        dequantize(values, query.dtype, scales[1]),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [B, H, 1, D]
    return out.squeeze(2)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D]: the new tokens of every prefilling sequence, concatenated
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D], the new tokens' keys already stored
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [S+1]: query offsets of each sequence
    context_lens: torch.Tensor,  # [S]: keys per sequence (cached prefix + new tokens)
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    k_scale: float = 1.0,  # an fp8 cache's keys are k_cache * k_scale (kernels/kv_quant.py)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its whole context. The new tokens are
    the last `q_len` of the context, so a prefix held in cached pages is attended too."""
    fn = pick("paged_prefill_attention", query, paged_prefill_attention_ref)
    return fn(
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale,
        max_query_len,
        max_context_len,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_prefill_attention_ref(
    query,
    k_cache,
    v_cache,
    cu_seqlens_q,
    context_lens,
    block_tables,
    scale,
    *_length_hints,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    # _length_hints: max_query_len and max_context_len, which only the Triton kernel uses.
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        pages = block_tables[i, : -(-ctx // block_size)].long()
        keys = gather_pages(k_cache, pages).flatten(0, 1)[:ctx].transpose(0, 1)
        values = gather_pages(v_cache, pages).flatten(0, 1)[:ctx].transpose(0, 1)
        # Batched 4-d inputs ([1, heads, len, D]): on the CPU, torch's SDPA takes its flash
        # kernel only for those (3-d ones go to its math path, which materializes the scores:
        # 3-8x slower for the default model's 256-1,024-token prompts on the 2-core build machine).
        keys = dequantize(keys, query.dtype, k_scale).unsqueeze(0)  # [1, Hkv, ctx, D]
        values = dequantize(values, query.dtype, v_scale).unsqueeze(0)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if q_len == ctx:
            o = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query j sits at position ctx - q_len + j and sees keys up to it.
            qpos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
