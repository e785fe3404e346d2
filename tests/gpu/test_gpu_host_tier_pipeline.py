"""The host tier's pipelined copies on a GPU: offloads (compute stream) and loads (a stream of
their own) chunk by chunk, a load into a block never before the offload of its old KV. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.kv_cache.host import pool as host_pool
from pdmesh.engine.kv_cache.host.pool import HostPool
from pdmesh.engine.kv_cache.paged import KVCacheSpec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", [False, True])
def test_loads_into_just_offloaded_blocks_wait_for_those_offloads(monkeypatch, overlap) -> None:
    """Every block offloaded to one slot and loaded from another in the same call, the loads'
    chunks in the reverse order of the offloads' (the first load chunk overwrites the blocks
    the last offload chunk reads): the slots get the blocks' old KV, the blocks the slots'."""
    monkeypatch.setattr(host_pool, "CHUNK", 4)
    spec = KVCacheSpec(
        num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    device = torch.device("cuda")
    pool = HostPool(spec, num_slots=64, device=device)
    cache = torch.randn(3, 2, 40, 16, 2, 64, device=device).to(torch.bfloat16)
    pool.data[32:].copy_(torch.randn(pool.data[32:].shape).to(torch.bfloat16))
    blocks = list(range(2, 34))  # 32 blocks: 8 chunks of 4
    old, new = cache[:, :, blocks].clone(), pool.data[32:].clone()
    offloads = [x for i, b in enumerate(blocks) for x in (b, i)]
    loads = [x for i, b in enumerate(reversed(blocks)) for x in (32 + i, b)]
    pool.copy(cache, offloads, loads, overlap=overlap)
    if overlap:
        assert pool.loading
        pool.copy(cache, [], [])  # the next step waits for them
    torch.cuda.synchronize()
    assert torch.equal(pool.data[:32], old.movedim(2, 0).cpu())
    assert torch.equal(cache[:, :, blocks[::-1]].movedim(2, 0).cpu(), new)


def test_prefix_loaded_into_the_blocks_it_evicts_matches_transformers(
    tiny_model, monkeypatch
) -> None:
    """A prefix of 8 blocks comes back from the host tier into the device blocks of the prompt
    that evicted it, offloaded in the same step, over several pipelined chunks."""
    monkeypatch.setattr(host_pool, "CHUNK", 2)
    folder = tiny_model("llama")
    prefix, tail_a, filler, tail_b = random_prompts([128, 10, 140, 8], seed=12)
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=160, kv_offload_gib=0.002)
    for prompt in (prefix + tail_a, filler, prefix + tail_b):
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        )[0]
    assert out.num_cached_tokens == 128
    assert out.outputs[0].token_ids == hf_greedy(load_hf(folder), prefix + tail_b, 16, True)
    stats = llm.engine.stats()
    assert stats.host_tier_hit_tokens == 128 and stats.kv_blocks_free == stats.kv_blocks_total
