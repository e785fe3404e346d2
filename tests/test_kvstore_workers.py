"""Workers using a KV store (`--kvstore`), as real processes: a decode worker reuses a prefix that
another computed and published (counted by both and by the store, output equal to transformers');
a store that answers with other blocks' tokens, and one killed in the middle of a fetch, cost a
recompute and never a wrong or failed request. The lying and dying store is a real gRPC server
in this process around a real store, with the lie or the stall added to its Get."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from mesh_support import free_port, greedy_tokens, start_mesh
from service_support import Service, wait_until, wait_workers
from support import hf_greedy, load_hf, random_prompts

from pdmesh.kvstore_service.config import KVStoreConfig
from pdmesh.kvstore_service.metrics import KVStoreMetrics
from pdmesh.kvstore_service.server import SERVICE, claim_data_port
from pdmesh.kvstore_service.servicer import KVStoreServicer
from pdmesh.kvstore_service.store import KVStore
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.v1 import kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.timeout(180)
BLOCK = 16  # the engine's default block size


def store_stats(address: str) -> kvstore_pb2.KVStoreStats:
    with grpc.insecure_channel(address) as ch:
        return kvstore_pb2_grpc.KVStoreStub(ch).GetStats(
            kvstore_pb2.KVStoreStatsRequest(), timeout=5
        )


@pytest.mark.parametrize(
    "role, layout",
    [
        ("decode", ["--prefill", "0", "--decode", "2"]),
        # Every prompt to a prefill worker; the decode worker holds the prefix after the first
        # turn, so the second worker computes (and pushes) only the tail, fetching the prefix.
        ("prefill", ["--prefill", "2", "--decode", "1", "--disagg-min-tokens", "0"]),
    ],
)
def test_a_worker_reuses_a_prefix_another_computed(tiny_model, role, layout) -> None:
    """`pdmesh up --kvstore` hands the store to every worker; round robin sends the second turn
    to the worker of `role` that never saw the first, which fetches the shared prefix."""
    folder = tiny_model("llama")
    mesh = start_mesh(
        "--model", str(folder), "--kvstore", "--policy", "round_robin", *layout
    )  # fmt: skip
    prefix, tail_a, tail_b = random_prompts([4 * BLOCK, 10, 12], seed=21)
    try:
        (first,) = asyncio.run(greedy_tokens(mesh.target, [prefix + tail_a], 8))
        (store,) = mesh.kvstore
        wait_until(lambda: store_stats(store).blocks_held >= 4, 10, "the prefix published")
        (got,) = asyncio.run(greedy_tokens(mesh.target, [prefix + tail_b], 8))
        workers = getattr(mesh, role)
        a, b = sorted((mesh.stats(w) for w in workers), key=lambda s: s.store_hit_blocks)
        held = store_stats(store)
    finally:
        mesh.stop()
    hf = load_hf(folder)
    assert first == hf_greedy(hf, prefix + tail_a, 8, ignore_eos=True)
    assert got == hf_greedy(hf, prefix + tail_b, 8, ignore_eos=True)
    assert b.store_hit_blocks == 4 and b.store_hit_tokens == 4 * BLOCK
    assert b.store_fetched_bytes > 0 and b.store_fetch_seconds > 0 and b.store_hit_rate > 0
    assert a.store_hit_blocks == 0 and a.store_published_blocks == 4
    assert held.hit_blocks >= 4 and held.blocks_served == 4


class FaultyStore(KVStoreServicer):
    """A real store whose answers can be made to lie or hang.

    "lie": Lookup claims every block; Get serves the blocks of `other` (a prompt the store
    really holds) for whatever is asked, and its reply names `other`'s tokens. "hang": Lookup
    claims every block and Get never answers (the test then kills the server)."""

    mode = "honest"
    other: tuple[int, ...] = ()
    get_started: threading.Event

    async def Lookup(self, request, context):
        if self.mode == "honest":
            return await super().Lookup(request, context)
        return kvstore_pb2.KVLookupReply(num_blocks=len(request.token_ids) // BLOCK)

    async def Get(self, request, context):
        self.get_started.set()
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "lie":
            lie = kvstore_pb2.KVGetRequest()
            lie.CopyFrom(request)
            del lie.token_ids[:]
            lie.token_ids.extend(self.other[: len(request.token_ids)])
            request = lie
        return await super().Get(request, context)


@dataclass
class StoreThread:
    """A FaultyStore served on a loop of its own thread."""

    servicer: FaultyStore
    address: str = ""
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    server: grpc.aio.Server | None = None

    def start(self) -> StoreThread:
        ready = threading.Event()

        async def serve() -> None:
            spec = ServiceSpec(
                SERVICE, kvstore_pb2_grpc.add_KVStoreServicer_to_server, self.servicer
            )
            self.server, _, port = build_server("127.0.0.1:0", [spec])
            await self.server.start()
            self.address = f"127.0.0.1:{port}"
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        assert ready.wait(10)
        return self

    def kill(self) -> None:
        assert self.server is not None
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.servicer.store.close()


@pytest.fixture
def faulty(tiny_model, tmp_path_factory) -> Iterator[tuple[StoreThread, Service, Service]]:
    config = claim_data_port(KVStoreConfig(bind="127.0.0.1:0", data_bind="tcp://127.0.0.1:0"))
    store = KVStore(config)
    servicer = FaultyStore(store, KVStoreMetrics(store.stats))
    servicer.get_started = threading.Event()
    thread = StoreThread(servicer).start()
    logs = tmp_path_factory.mktemp("kvstore-workers")
    decode = Service(
        "decode",
        ["--port", str(free_port()), "--model", str(tiny_model("llama")),
         "--kvstore", thread.address, "--kvstore-fetch-timeout", "30"],
        logs / "decode.log",
    ).start()  # fmt: skip
    router = Service(
        "router", ["--port", str(free_port()), "--http-port", "0", "--decode", decode.address],
        logs / "router.log",
    ).start()  # fmt: skip
    try:
        decode.wait_serving()
        router.wait_serving()
        wait_workers(router.address, 0, 1)
        yield thread, decode, router
    finally:
        router.stop()
        decode.stop()
        thread.loop.call_soon_threadsafe(thread.loop.stop)


def test_a_lying_or_dying_store_costs_a_recompute_never_a_request(tiny_model, faulty) -> None:
    thread, decode, router = faulty
    store = thread.servicer
    prefixes, tails = random_prompts([4 * BLOCK] * 3, seed=31), random_prompts([9, 11, 13], 32)
    q, p, r = (prefix + tail for prefix, tail in zip(prefixes, tails, strict=True))
    hf = load_hf(tiny_model("llama"))
    # Honest: Q is computed and published.
    asyncio.run(greedy_tokens(router.address, [q], 6))
    wait_until(lambda: store.store.stats().blocks_held >= 4, 10, "Q published")

    # A liar: it claims P and serves Q's blocks, saying so in its reply. The worker must not use
    # them (with Q's KV under P's prefix its output would differ).
    store.mode, store.other = "lie", tuple(q)
    (got_p,) = asyncio.run(greedy_tokens(router.address, [p], 6))
    lied = decode.stats()
    assert got_p == hf_greedy(hf, p, 6, ignore_eos=True)
    assert store.get_started.is_set() and store.store.stats().blocks_served == 4
    assert lied.store_fetch_failures == 1 and lied.store_hit_blocks == 0

    # Killed while a fetch waits on it: the request is computed, correctly, well within the
    # worker's 30 s fetch timeout.
    time.sleep(1.2)  # the client left the liar alone for a second
    store.mode = "hang"
    store.get_started.clear()
    loop = asyncio.new_event_loop()
    try:
        pending = loop.create_task(greedy_tokens(router.address, [r], 6))
        while not store.get_started.is_set():
            loop.run_until_complete(asyncio.sleep(0.05))
        started = time.monotonic()
        thread.kill()
        (got_r,) = loop.run_until_complete(pending)
        took = time.monotonic() - started
    finally:
        loop.close()
    killed = decode.stats()
    assert got_r == hf_greedy(hf, r, 6, ignore_eos=True)
    assert took < 10 and killed.store_fetch_failures == 2 and killed.store_hit_blocks == 0
    assert killed.kv_blocks_used == 0 and decode.serving()


def test_the_kv_policy_counts_store_blocks_as_cheaper_than_a_miss(tmp_path) -> None:
    """The router's StoreHits learns the geometry from a real store and looks a prompt up; with
    the store's blocks, the policy sends the prompt to an idle prefill worker rather than a busy
    one holding half of it, and lets a decode worker prefill what the store nearly covers."""
    from kvstore_support import GEOMETRY, publish, tokens_of

    from pdmesh.kvstore_service.client import KVStoreClient
    from pdmesh.prefix_hash import hash_prefix_blocks
    from pdmesh.router.policies import PromptInfo, create_policy
    from pdmesh.router.registry import Worker
    from pdmesh.router.store_hits import StoreHits

    bs = GEOMETRY.block_size
    prompt = tokens_of(50, 8, extra=1)  # 8 full blocks and one token
    argv = ["--port", str(free_port()), "--data-port", "0", "--capacity-gib", "0.01"]
    store = Service("kvstore", argv, tmp_path / "kvstore.log").start()

    async def run() -> tuple[int, int]:
        hits = StoreHits(store.address, timeout_s=2)
        before = await hits.blocks(prompt)  # no geometry yet: nothing, at once
        client = KVStoreClient(store.address, GEOMETRY)
        await publish(client, prompt[: 8 * bs])
        hits._next_try = 0  # the next lookup asks for the geometry now, not in 2 s
        after = await hits.blocks(prompt)
        await client.close()
        await hits.close()
        return before, after

    try:
        store.wait_serving()
        before, after = asyncio.run(run())
    finally:
        store.stop()
    assert (before, after) == (0, 8)
    info = PromptInfo(len(prompt), hash_prefix_blocks(prompt, bs), bs)
    busy, idle, decode = (
        Worker("busy:1", "prefill"),
        Worker("idle:1", "prefill"),
        Worker("d:1", "decode"),
    )
    busy.index.insert(info.block_hashes[:4])
    busy.load.kv_blocks_used = 3
    policy = create_policy("kv", overlap_weight=1.0, disagg_min_tokens=2 * bs)
    alone = policy.choose(info, [decode], [busy, idle])
    with_store = policy.choose(
        PromptInfo(info.num_tokens, info.block_hashes, bs, after), [decode], [busy, idle]
    )
    assert alone.prefill is busy and alone.prefill_miss_blocks == 5
    assert with_store.prefill is None  # 1 block (the last token's) left: prefilled locally
    policy = create_policy("kv", overlap_weight=1.0, disagg_min_tokens=1)
    with_store = policy.choose(
        PromptInfo(info.num_tokens, info.block_hashes, bs, after), [decode], [busy, idle]
    )
    assert with_store.prefill is idle and with_store.prefill_miss_blocks == 1


def test_pdmesh_up_hands_its_store_to_every_worker_and_the_router() -> None:
    from pdmesh.cli import build_parser
    from pdmesh.decode_service.config import DecodeConfig
    from pdmesh.engine.config import EngineConfig
    from pdmesh.mesh import plan_mesh
    from pdmesh.serving.store_link import StoreOptions

    parser = build_parser()
    specs = plan_mesh(parser.parse_args(["up", "--kvstore", "--decode", "2"]))
    store = specs[0]
    for spec in specs[1:]:
        flag = spec.command.index("--kvstore")
        assert spec.command[flag + 1] == store.address, spec.name
    with pytest.raises(ValueError, match="one rank"):
        plan_mesh(parser.parse_args(["up", "--kvstore", "--decode-tp", "2"]))
    with pytest.raises(ValueError, match="one rank"):
        DecodeConfig(EngineConfig(tensor_parallel_size=2), kvstore=StoreOptions("10.0.0.9:50081"))
    with pytest.raises(ValueError, match="HOST:PORT"):
        StoreOptions("10.0.0.9")
