"""Triton KV-cache store, paged decode and paged prefill attention against the references."""

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
from pdmesh.kernels.triton import decode_attention

BS = 16
# Cache slots no sequence owns hold this: a kernel that reads past a context sees a huge key.
UNUSED = 1000.0

Check = Callable[[torch.Tensor, torch.Tensor], None]


def _paged_cache(
    contexts: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): each context's K/V in shuffled pages; page 0 and the tail
    of each last page unused; tables padded with 0 as the engine pads them."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-ctx // BS) for ctx in contexts]
    num_blocks = sum(pages) + 3
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    k_cache = torch.full(shape, UNUSED)
    v_cache = torch.full(shape, UNUSED)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    for i, ctx in enumerate(contexts):
        for j in range(pages[i]):
            block = free.pop()
            tables[i, j] = block
            used = min(BS, ctx - j * BS)
            k_cache[block, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g)
            v_cache[block, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g)
    return k_cache.to(device, dtype), v_cache.to(device, dtype), tables.to(device)


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 64), (8, 128)])
def test_store_kv_cache_writes_slots_and_skips_padding(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    num_tokens, num_blocks = 37, 6
    g = torch.Generator().manual_seed(num_kv_heads)
    # k and v as the model makes them: views into one fused qkv projection, rows not dense.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(device, dtype)
    key, value, _ = qkv.view(num_tokens, 3 * num_kv_heads, head_dim).split(num_kv_heads, dim=1)
    slots = torch.randperm(num_blocks * BS, generator=g)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(device)
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv_cache(key, value, k_cache, v_cache, slots)
    store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, contexts)
    (4, 4, 64, [5, 17, 33]),
    (6, 2, 128, [40, 300]),
    (8, 2, 64, [1, 16, 100, 700]),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "contexts"), DECODE_CASES)
def test_paged_decode_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    contexts: list[int],
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    k_cache, v_cache, tables = _paged_cache(contexts, num_kv_heads, head_dim, dtype, device, seed=1)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(len(contexts), num_heads, head_dim, generator=g).to(device, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    scale = head_dim**-0.5

    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, max(contexts))
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, scale, max(contexts))
    assert_close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_paged_decode_any_split_count_gives_the_same_attention(
    num_splits: int, dtype: torch.dtype, device: torch.device, assert_close: Check
) -> None:
    # 9 splits of a 20-token context leave most splits empty; 1 split writes directly.
    contexts = [20, 129, 250]
    k_cache, v_cache, tables = _paged_cache(contexts, 2, 64, dtype, device, seed=3)
    query = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)

    out = decode_attention.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits
    )
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, 0.125)
    assert_close(out, ref)


def test_decode_splits_fill_the_gpu_only_when_the_batch_does_not() -> None:
    h100_sms = 132
    # 1 sequence x 8 KV heads alone would leave most SMs idle: split its long context.
    assert decode_attention.choose_num_splits(1, 8, 4096, h100_sms) >= 16
    # 512 programs on 132 SMs: a second split's merge would cost more than its wave adds.
    assert decode_attention.choose_num_splits(64, 8, 4096, h100_sms) == 1
    assert decode_attention.choose_num_splits(32, 8, 8192, h100_sms) == 3
    # Under MIN_SPLIT_TOKENS per split, a split costs more than it saves.
    assert decode_attention.choose_num_splits(1, 8, 100, h100_sms) == 1


PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, query lengths, context lengths)
    (4, 4, 64, [50], [50]),
    (6, 2, 128, [70, 5, 60], [70, 33, 130]),
    (8, 2, 64, [1, 64, 100], [17, 64, 250]),
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "q_lens", "contexts"), PREFILL_CASES
)
def test_paged_prefill_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_lens: list[int],
    contexts: list[int],
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    # q_len < context: a prefix-cached prompt whose new tokens attend to the cached pages too.
    k_cache, v_cache, tables = _paged_cache(contexts, num_kv_heads, head_dim, dtype, device, seed=5)
    g = torch.Generator().manual_seed(6)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, k_cache, v_cache, cu, lens, tables, head_dim**-0.5, max(q_lens), max(contexts))

    out = paged_prefill_attention(*args)
    ref = paged_prefill_attention_ref(*args)
    assert_close(out, ref)


def test_warm_up_runs_a_mixed_step_and_stores_nothing(
    dtype: torch.dtype, device: torch.device
) -> None:
    """`Attention.warm_up` (run when an engine starts on a GPU, so that no kernel is compiled in
    the middle of a step) passes one decode and one prefill row through the kernels, written
    directly and in splits, and leaves every cache slot as it was."""
    from pdmesh.engine.layers.attention import Attention

    layer = Attention(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125)
    k_cache, v_cache, _ = _paged_cache([40, 7], 2, 64, dtype, device, seed=3)
    layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
    layer.warm_up(dtype, 1024)
    assert torch.equal(layer.k_cache, k_cache)
    assert torch.equal(layer.v_cache, v_cache)
