"""The host-memory KV tier (`kv_offload_gib`): blocks evicted from the device prefix cache are
kept in host memory and loaded back instead of recomputed, with output identical to a
recompute, on one rank, over tensor-parallel ranks and over pipeline stages."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mesh_support import greedy_tokens, start_mesh
from prometheus_client import generate_latest
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.kv_cache.host.index import HostCopies, HostHit, HostIndex
from pdmesh.engine.kv_cache.host.pool import CHUNK, HostPool
from pdmesh.engine.kv_cache.paged import KVCacheSpec
from pdmesh.engine.sequence import Sequence
from pdmesh.observability.worker_collector import WorkerSnapshot, worker_registry
from pdmesh.v1.worker_pb2 import WorkerStats

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _gib_for(folder: Path, slots: int, ranks: int = 1) -> float:
    """kv_offload_gib that holds `slots` blocks of the model in `folder` (float32)."""
    c = json.loads((folder / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    block_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * BLOCK
    return (slots + 0.5) * block_bytes / 2**30


def _tiered(folder: Path, **options: Any) -> LLM:
    """The tiny model in a 160-token device cache over a 32-block host tier."""
    base = dict(kv_cache_tokens=160, block_size=BLOCK, kv_offload_gib=_gib_for(folder, 32))
    return LLM(str(folder), **{**base, **options})


def _run_evicting(llm: LLM) -> tuple[list[int], list[list[int]], int]:
    """A prompt, a longer unrelated one that takes every device block (evicting the first's
    prefix), then the first's 64-token prefix with another tail, greedy and with two seeded
    choices (forked from the loaded blocks). Returns the last prompt, its outputs (greedy, then
    the two choices) and its cached tokens."""
    prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
    llm.generate([{"prompt_token_ids": prefix + tail_a}], GREEDY)
    llm.generate([{"prompt_token_ids": filler}], GREEDY)
    again = prefix + tail_b
    greedy = llm.generate([{"prompt_token_ids": again}], GREEDY)[0]
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=2, ignore_eos=True)
    choices = llm.generate([{"prompt_token_ids": again}], seeded)[0]
    tokens = [greedy.outputs[0].token_ids, *(c.token_ids for c in choices.outputs)]
    return again, tokens, greedy.num_cached_tokens


@pytest.fixture(scope="module")
def recomputed(tiny_model) -> list[list[int]]:
    """The outputs of `_run_evicting` with the tier off: the prefix is recomputed."""
    with LLM(str(tiny_model("llama")), kv_cache_tokens=160, block_size=BLOCK) as llm:
        _, tokens, cached = _run_evicting(llm)
        stats = llm.engine.stats()
    assert cached == 0  # evicted, nothing to load it from
    assert llm.engine.runner.host_pool is None  # off: no pool, no copies in any step
    assert stats.host_tier_blocks_total == stats.host_tier_hit_tokens == 0
    return tokens


def test_evicted_prefix_is_loaded_from_the_host_tier(tiny_model, recomputed) -> None:
    folder = tiny_model("llama")
    with _tiered(folder) as llm:
        prompt, tokens, cached = _run_evicting(llm)
        stats = llm.engine.stats()
        block_bytes = llm.engine.runner.kv_spec.bytes_per_block
    assert cached == 64  # the 4 prefix blocks, none of them on the device any more
    # The greedy request hit 4 blocks; the two choices' request then found them on the device.
    assert stats.host_tier_hit_blocks == 4 and stats.host_tier_hit_tokens == 64
    assert stats.host_tier_loaded_bytes == 4 * block_bytes
    assert stats.host_tier_offloaded_bytes >= 5 * block_bytes  # the first prompt's full blocks
    assert stats.host_tier_copy_seconds > 0
    assert stats.host_tier_blocks_total == 32 and 0 < stats.host_tier_blocks_used <= 32
    assert stats.prefix_hit_tokens == 80  # the device's: the choices' request, after the load
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert tokens == recomputed
    assert tokens[0] == hf_greedy(load_hf(folder), prompt, 8, ignore_eos=True)
    # What a worker's GetStats and /metrics carry.
    fields = dataclasses.asdict(stats)
    assert WorkerStats(**fields).host_tier_hit_tokens == 64
    snapshot = WorkerSnapshot(fields, ())
    text = generate_latest(worker_registry("decode", lambda: snapshot)).decode()
    assert 'pdmesh_host_kv_hit_tokens_total{role="decode"} 64.0' in text
    assert f'pdmesh_host_kv_loaded_bytes_total{{role="decode"}} {4 * block_bytes}.0' in text


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_loading_its_prefix_sits_out_the_step_that_loads_it(
    tiny_model, recomputed, tp: int
) -> None:
    """With loads beside the forward (as on a GPU), a step that has other work loads the
    prefix of a request it admits without running it: the running request is not held up, and
    the loading one starts on the next step (every rank told so with the step)."""
    folder = tiny_model("llama")
    with _tiered(folder, tensor_parallel_size=tp) as llm:
        engine = llm.engine
        engine.scheduler.overlap_loads = True
        prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
        llm.generate([{"prompt_token_ids": prefix + tail_a}], GREEDY)
        llm.generate([{"prompt_token_ids": filler}], GREEDY)
        engine.add_request("busy", random_prompts([10], seed=2)[0], GREEDY)
        assert [d.request_id for d in engine.step()] == ["busy"]
        engine.add_request("again", prefix + tail_b, GREEDY)
        assert [d.request_id for d in engine.step()] == ["busy"]  # "again" loads meanwhile
        assert "again" in {d.request_id for d in engine.step()}
        while engine.has_unfinished_requests():
            engine.step()
        out = engine.get_output("again")
        stats = engine.stats()
    assert out.num_cached_tokens == 64 and stats.host_tier_hit_tokens == 64
    assert out.outputs[0].token_ids == recomputed[0]
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("tp", [1, 2])
def test_blocks_a_reservation_takes_are_offloaded_at_once(tiny_model, recomputed, tp) -> None:
    """A prompt prefilled elsewhere takes the cached prefix's blocks: they reach the host tier
    before the reservation is handed out (a KV receiver writes them next), on every rank."""
    folder = tiny_model("llama")
    with _tiered(folder, tensor_parallel_size=tp) as llm:
        engine = llm.engine
        prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
        llm.generate([{"prompt_token_ids": prefix + tail_a}], GREEDY)
        before = engine.stats().host_tier_offloaded_bytes
        assert engine.reserve_prefill("remote", filler, GREEDY) is not None
        assert engine.stats().host_tier_offloaded_bytes > before
        for block_id in engine.scheduler._reserved["remote"].block_table:
            engine.runner.kv_cache.data[:, :, block_id] = 7.0  # what the remote KV overwrote
        engine.release_prefill("remote")  # its prefill failed: prefilled here instead
        while engine.has_unfinished_requests():
            engine.step()
        out = llm.generate([{"prompt_token_ids": prefix + tail_b}], GREEDY)[0]
        stats = engine.stats()
    assert out.num_cached_tokens == 64 and stats.host_tier_hit_tokens == 64
    assert out.outputs[0].token_ids == recomputed[0]
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_host_tier_over_parallel_ranks(tiny_model, recomputed, layout: str) -> None:
    """Every rank copies its own heads (tensor parallel) or layers (pipeline) with each step."""
    folder = tiny_model("llama")
    ranks = {"tensor_parallel_size": 2} if layout == "tp2" else {"pipeline_parallel_size": 2}
    with _tiered(folder, **ranks) as llm:
        _, tokens, cached = _run_evicting(llm)
        stats = llm.engine.stats()
    assert cached == 64 and stats.host_tier_hit_tokens == 64
    assert stats.host_tier_blocks_total == 32  # half the bytes on each of the two ranks
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert tokens == recomputed


def test_busy_cache_with_a_small_host_tier_matches_transformers(tiny_model) -> None:
    """Prompts sharing a prefix in a cache small enough to preempt, with a host tier smaller
    than what is evicted (its slots reused least recently used first)."""
    folder = tiny_model("llama")
    shared = random_prompts([48], seed=7)[0]
    prompts = [shared + p for p in random_prompts([5, 30, 90, 17], seed=3)]
    prompts += random_prompts([150, 70], seed=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(
        str(folder),
        kv_cache_tokens=256,
        block_size=BLOCK,
        max_num_batched_tokens=64,
        kv_offload_gib=_gib_for(folder, 6),
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params)
        stats = llm.engine.stats()
    hf = load_hf(folder)
    for prompt, out in zip(prompts + prompts[:4], outputs + again, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16, ignore_eos=True)
    assert stats.num_preemptions > 0
    assert stats.host_tier_blocks_used == stats.host_tier_blocks_total == 6
    assert stats.host_tier_hit_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_decode_worker_serves_an_evicted_prefix_from_its_host_tier(tiny_model) -> None:
    """`pdmesh up` passes the option to its worker; GetStats counts the hit."""
    folder = tiny_model("llama")
    mesh = start_mesh(
        "--model", str(folder), "--prefill", "0", "--decode", "1", "--kv-cache-tokens", "160",
        "--kv-offload-gib", str(_gib_for(folder, 32)),
    )  # fmt: skip
    prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
    try:
        for prompt in (prefix + tail_a, filler):  # one after the other: the second evicts
            asyncio.run(greedy_tokens(mesh.target, [prompt], 8))
        (got,) = asyncio.run(greedy_tokens(mesh.target, [prefix + tail_b], 8))
        stats = mesh.stats(mesh.decode[0])
    finally:
        mesh.stop()
    assert stats.host_tier_hit_tokens == 64 and stats.host_tier_blocks_total == 32
    assert stats.host_tier_loaded_bytes > 0 and stats.host_tier_copy_seconds > 0
    assert got == hf_greedy(load_hf(folder), prefix + tail_b, 8, ignore_eos=True)


def test_pool_round_trip_in_chunks() -> None:
    """More blocks than one chunk of scratch, out to the host and back into other blocks."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
    n = 2 * CHUNK + 3
    cache = torch.randn(2, 2, 2 * n, 4, 2, 4)
    pool = HostPool(spec, n, torch.device("cpu"))
    slots = list(range(n))[::-1]
    pool.copy(cache, [x for b, s in zip(range(n), slots, strict=True) for x in (b, s)], [])
    pool.copy(cache, [], [x for s, b in zip(slots, range(n, 2 * n), strict=True) for x in (s, b)])
    assert torch.equal(cache[:, :, n:], cache[:, :, :n])
    assert pool.seconds > 0


def test_host_slots_are_reused_least_recently_used_first() -> None:
    index = HostIndex(2)
    hits = [HostHit(h, 0, (h,)) for h in (1, 2, 3)]
    for block_id, hit in enumerate(hits[:2]):
        index.offload(block_id, *hit)
    assert index.take_copies().offloads == ((0, 0), (1, 1))
    assert index.lookup(*hits[0]) and index.lookup(*hits[1])
    assert not index.lookup(1, 0, (9,))  # same hash, other tokens: a miss
    (slot,) = index.claim([hits[0]])  # a hit makes block 1 the most recently used
    index.load(slot, 7)
    index.offload(5, *hits[2])  # evicts block 2, the least recently used
    assert index.take_copies() == HostCopies(((5, 1),), ((0, 7),))
    assert index.lookup(*hits[0]) and index.lookup(*hits[2]) and not index.lookup(*hits[1])
    index.offload(6, *hits[0])  # held already: no copy
    assert index.take_copies() == HostCopies((), ())
    assert index.evicted_blocks == 1 and index.hit_blocks == 1


def test_pinned_slots_are_not_reused_before_their_copies_run() -> None:
    index = HostIndex(1)
    index.offload(0, 1, 0, (1,))
    index.offload(1, 2, 0, (2,))  # the only slot is being written: this block is not kept
    assert index.take_copies().offloads == ((0, 0),)
    assert index.lookup(1, 0, (1,)) and not index.lookup(2, 0, (2,))


def test_off_by_default_and_checked(tiny_model) -> None:
    assert EngineConfig().kv_offload_gib == 0
    with pytest.raises(ValueError, match="kv_offload_gib must be"):
        EngineConfig(kv_offload_gib=-1)
    folder = str(tiny_model("llama"))
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(folder, kv_cache_tokens=160, kv_offload_gib=1e-9)
    # Without prefix caching nothing is ever evicted with a hash: no pool is allocated.
    llm = LLM(folder, kv_cache_tokens=160, kv_offload_gib=1, enable_prefix_caching=False)
    assert llm.engine.runner.host_pool is None and llm.engine.host_index is None


# -- the bookkeeping, against a model of the KV each block and slot holds -----------------------
B, NUM_BLOCKS, NUM_SLOTS = 4, 10, 3


class HostTierMachine(RuleBasedStateMachine):
    """Random admits (some as reservations given up before any step), steps and finishes.
    Each block and slot holds a list of the tokens whose KV is there; a step runs its host
    copies (offloads, then loads) and writes its tokens. Every computed token of every live
    sequence must find its own KV, and every cached block must hold its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.host = HostIndex(NUM_SLOTS)
        self.bm = BlockManager(NUM_BLOCKS, B, host=self.host)
        self.kv: list[list[int | None]] = [[None] * B for _ in range(NUM_BLOCKS)]
        self.slots: list[list[int | None]] = [[None] * B for _ in range(NUM_SLOTS)]
        self.live: list[Sequence] = []
        self.n = 0

    def _run(self, seq: Sequence | None, n: int) -> None:
        offloads, loads, _ = self.bm.take_host_copies()
        for block_id, slot in offloads:
            self.slots[slot] = list(self.kv[block_id])
        for slot, block_id in loads:
            self.kv[block_id] = list(self.slots[slot])
        if seq is not None:
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[seq.block_table[p // B]][p % B] = seq.token_ids[p]
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)

    def _new(self, tokens: list[int]) -> Sequence:
        self.n += 1
        return Sequence(f"s{self.n}", tokens, _PARAMS)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=24), chunk=st.integers(1, 12))
    def admit(self, tokens: list[int], chunk: int) -> None:
        seq = self._new(tokens)
        prefix = self.bm.match_prefix(seq)
        n = min(seq.num_tokens - len(prefix) * B, chunk)
        if self.bm.can_allocate(seq, n, prefix):
            self.bm.allocate(seq, n, prefix)
            self._run(seq, n)
            self.live.append(seq)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=24))
    def reserve_and_give_up(self, tokens: list[int]) -> None:
        """A remote prefill's reservation (the cached blocks it takes copied out at once), given
        up before any step ran."""
        seq = self._new(tokens)
        prefix = self.bm.match_prefix(seq)
        n = seq.num_tokens - len(prefix) * B
        if self.bm.can_allocate(seq, n, prefix):
            self.bm.allocate(seq, n, prefix)
            for block_id, slot in self.bm.take_offloads():
                self.slots[slot] = list(self.kv[block_id])
            for block_id in seq.block_table[len(prefix) :]:
                self.kv[block_id] = [-1] * B  # what a half-received transfer left there
            self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 8), token=st.integers(0, 1))
    def step(self, i: int, chunk: int, token: int) -> None:
        seq = self.live[i % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)
        n = min(seq.num_uncomputed_tokens, chunk)
        if self.bm.can_allocate(seq, n):
            self.bm.allocate(seq, n)
            self._run(seq, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        self.bm.free(self.live.pop(i % len(self.live)))

    @invariant()
    def computed_tokens_find_their_kv(self) -> None:
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // B]][p % B] == seq.token_ids[p]

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for block in self.bm.blocks:
            if block.hash is not None:
                assert tuple(self.kv[block.block_id]) == block.token_ids

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS


_PARAMS = SamplingParams()
HostTierMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestHostTier = HostTierMachine.TestCase
