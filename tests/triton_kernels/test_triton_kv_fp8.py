"""The Triton KV store, paged decode and paged prefill attention over an fp8 (e4m3) cache with a
K and a V scale, against the torch references (kernels/attention.py, kernels/kv_quant.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from pdmesh.kernels.attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_cache_ref,
)
from pdmesh.kernels.kv_quant import FP8_KV_DTYPE, quantize
from pdmesh.kernels.triton import decode_attention

BS = 16
# Scales other than 1 in both directions, so that a kernel that drops one, swaps K's and V's, or
# multiplies where it should divide is off by 4x or more.
K_SCALE, V_SCALE = 0.5, 2.0

Check = Callable[[torch.Tensor, torch.Tensor], None]


def _fp8_paged_cache(
    contexts: list[int], num_kv_heads: int, head_dim: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): each context's K/V (randn x 3) quantized with K_SCALE /
    V_SCALE into shuffled fp8 pages; the other slots hold 448 (fp8's largest value), so a
    kernel reading past a context meets a huge key."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-ctx // BS) for ctx in contexts]
    num_blocks = sum(pages) + 3
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 448.0).to(FP8_KV_DTYPE)
    v_cache = torch.full(shape, 448.0).to(FP8_KV_DTYPE)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    for i, ctx in enumerate(contexts):
        for j in range(pages[i]):
            block = free.pop()
            tables[i, j] = block
            used = min(BS, ctx - j * BS)
            k = torch.randn(used, num_kv_heads, head_dim, generator=g) * 3
            v = torch.randn(used, num_kv_heads, head_dim, generator=g) * 3
            k_cache[block, :used] = quantize(k, FP8_KV_DTYPE, K_SCALE)
            v_cache[block, :used] = quantize(v, FP8_KV_DTYPE, V_SCALE)
    return k_cache.to(device), v_cache.to(device), tables.to(device)


def test_store_quantizes_as_the_reference_bit_for_bit(
    dtype: torch.dtype, device: torch.device
) -> None:
    num_tokens, num_blocks, heads, dim = 21, 4, 2, 64
    g = torch.Generator().manual_seed(0)
    key = (torch.randn(num_tokens, heads, dim, generator=g) * 4).to(device, dtype)
    value = (torch.randn(num_tokens, heads, dim, generator=g) * 4).to(device, dtype)
    # Saturate both ways; underflow to 0.0 and to -0.0 (a GPU's negation once gave +0.0).
    key[1, 0, :5] = torch.tensor([1e4, -1e4, 500.0, 1e-6, -1e-6])
    slots = torch.randperm(num_blocks * BS, generator=g)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(device)
    shape = (num_blocks, BS, heads, dim)
    k_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=device)
    v_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv_cache(key, value, k_cache, v_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    store_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    stored = k_cache.view(-1, heads, dim)[int(slots[1])].float()  # token 1 (slots[0] is -1)
    assert stored[0, :3].tolist() == [448.0, -448.0, 448.0]  # saturated, never NaN
    assert stored[0, 4] == 0 and torch.signbit(stored[0, 4])
    assert not torch.isnan(k_cache.float()).any() and not torch.isnan(v_cache.float()).any()


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, contexts)
    (4, 4, 64, [5, 17, 33]),
    (8, 2, 64, [1, 16, 100, 300]),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "contexts"), DECODE_CASES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_over_fp8_pages_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    contexts: list[int],
    num_splits: int | None,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    k_cache, v_cache, tables = _fp8_paged_cache(contexts, num_kv_heads, head_dim, device, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(contexts), num_heads, head_dim, generator=g).to(device, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, tables, lens, head_dim**-0.5, max(contexts))
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    if num_splits is None:
        out = paged_decode_attention(*args, **scales)
    else:
        out = decode_attention.paged_decode_attention(*args, num_splits, **scales)
    assert_close(out, paged_decode_attention_ref(*args, **scales))


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, (q_len, context) per sequence)
    (4, 2, 64, [(7, 7), (20, 45)]),
    (2, 1, 128, [(33, 33), (1, 50), (16, 16)]),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "seqs"), PREFILL_CASES)
def test_prefill_over_fp8_pages_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seqs: list[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    contexts = [ctx for _, ctx in seqs]
    k_cache, v_cache, tables = _fp8_paged_cache(contexts, num_kv_heads, head_dim, device, seed=3)
    g = torch.Generator().manual_seed(4)
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, max(q_lens), max(contexts))
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    assert_close(
        paged_prefill_attention(*args, **scales), paged_prefill_attention_ref(*args, **scales)
    )


@pytest.mark.parametrize(
    "tile",
    [None, decode_attention.DecodeTile(32, 2, f16_dot=True), decode_attention.DecodeTile(128, 4)],
    ids=["default", "32-tokens", "128-tokens-no-f16"],
)
def test_decode_over_fp8_pages_from_half_queries(
    tile: decode_attention.DecodeTile | None, device: torch.device, assert_close: Check
) -> None:
    """fp16 queries (bf16's case on a GPU; the interpreter has no bf16) over fp8 pages: by
    default the split kernel's dots run in fp16, which e4m3 converts to natively; the tiles a
    benchmark sweeps give the same output."""
    contexts = [1, 16, 100, 300]
    k_cache, v_cache, tables = _fp8_paged_cache(contexts, 2, 64, device, seed=3)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(len(contexts), 8, 64, generator=g).to(device, torch.float16)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, tables, lens, 64**-0.5, max(contexts))
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    assert decode_attention.default_tile(torch.float16, k_cache.dtype).f16_dot
    out = decode_attention.paged_decode_attention(*args, 3, **scales, tile=tile)
    assert out.dtype == torch.float16
    assert_close(out, paged_decode_attention_ref(*args, **scales))
