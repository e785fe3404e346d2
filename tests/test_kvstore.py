"""The KV store (`pdmesh kvstore`) as real processes on loopback, fed and read by real kv_transfer
tcp senders and receivers through its client: blocks come back byte for byte into other ranks'
blocks, a hit needs matching tokens, eviction is least recently used within the byte budget, and
a store that dies, stalls or answers garbage is a miss within the client's timeout."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from kvstore_support import (
    BLOCK_BYTES,
    GEOMETRY,
    GIB,
    bits,
    fetch_target,
    publish,
    pushes,
    receiving,
    scrape,
    sending,
    tokens_of,
    wait_for,
)
from otlp_receiver import OTLPReceiver
from service_support import Service
from tcp_proxy import TcpProxy

from pdmesh.kv_transfer import TransferSpec
from pdmesh.kvstore_service.client import KVStoreClient
from pdmesh.kvstore_service.types import PutTarget, StoreGeometry
from pdmesh.processes import free_port
from pdmesh.v1 import kvstore_pb2, kvstore_pb2_grpc


@dataclass
class Stores:
    main: Service  # 64 blocks; traced; stalled (SIGSTOP) by the last test
    small: Service  # 4 blocks: eviction
    doomed: Service  # killed mid-get
    metrics: str  # the main store's /metrics URL
    spans: OTLPReceiver


def _store(tmp: Path, name: str, blocks: int, *extra: str, env: dict | None = None) -> Service:
    argv = ["--port", str(free_port()), "--data-port", "0"]
    argv += ["--capacity-gib", repr(blocks * BLOCK_BYTES / GIB), *extra]
    return Service("kvstore", argv, tmp / f"{name}.log", env=env or {}).start()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    tmp, spans, metrics_port = tmp_path_factory.mktemp("kvstore"), OTLPReceiver(), free_port()
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{spans.endpoint}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    main = _store(tmp, "main", 64, "--metrics-port", str(metrics_port), env=otel)
    started = [main, _store(tmp, "small", 4), _store(tmp, "doomed", 64)]
    try:
        for s in started:
            s.wait_serving(60)
        yield Stores(*started, f"http://127.0.0.1:{metrics_port}/metrics", spans)
    finally:
        for s in started:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGCONT)
            s.stop()
        spans.stop()


def test_blocks_two_ranks_publish_come_back_byte_exact_into_other_ranks(stores: Stores) -> None:
    before = scrape(stores.metrics)
    tokens = tokens_of(seed=1, blocks=5, extra=2)  # 5 full blocks and 2 tokens more
    publisher = [sending(0, 2, seed=1), sending(2, 2, seed=2)]  # TP=2: two KV heads each
    src = [7, 3, 9, 0, 5]  # prompt block j sits in block src[j] of the publisher's caches
    one, two = [receiving(0, 4)], [receiving(0, 2), receiving(2, 2)]  # askers of TP 1 and 2

    async def run() -> KVStoreClient:
        client = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=5)
        assert client.publish(tokens, 0, pushes(publisher, src))
        await wait_for(lambda: client.stats.publishes == 1)
        assert await client.lookup(tokens) == 5
        spec = TransferSpec.new([2, 6, 1, 4, 0], head_start=0, num_heads=4)
        written = [one[0].receiver.expect(spec, 10)]
        assert await client.fetch(tokens, 0, 5, fetch_target(spec, one), written)
        # Blocks 2..4 only, into two ranks: each gets its own heads.
        spec = TransferSpec.new([5, 1, 3], head_start=0, num_heads=4)
        written = [r.receiver.expect(spec, 10) for r in two]
        assert await client.fetch(tokens, 2, 3, fetch_target(spec, two), written)
        await client.close()
        return client

    try:
        client = asyncio.run(run())
    finally:
        for rank in publisher + one + two:
            rank.close()
    # Every head of every layer of each block, bit for bit.
    expected = torch.cat([r.cache[:, :, src] for r in publisher], dim=4)
    assert torch.equal(bits(one[0].cache[:, :, [2, 6, 1, 4, 0]]), bits(expected))
    assert not one[0].cache[:, :, [3, 5, 7]].any(), "a block not asked for was written"
    for rank in two:
        got = rank.cache[:, :, [5, 1, 3]]
        assert torch.equal(bits(got), bits(expected[:, :, 2:, :, rank.heads]))
    s = client.stats
    assert (s.fetches, s.fetched_blocks, s.hit_blocks, s.failures) == (2, 8, 5, 0)

    after = scrape(stores.metrics)

    def delta(name: str, **labels: str) -> float:
        key = name + str(sorted(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pdmesh_kvstore_bytes_total", direction="in") == 5 * BLOCK_BYTES
    assert delta("pdmesh_kvstore_bytes_total", direction="out") == 8 * BLOCK_BYTES
    assert delta("pdmesh_kvstore_blocks_moved_total", direction="in") == 5
    assert delta("pdmesh_kvstore_lookup_blocks_total", result="hit") == 5
    assert delta("pdmesh_kvstore_transfers_total", direction="out", result="ok") == 2
    assert delta("pdmesh_kvstore_transfer_seconds_count", direction="in") == 1
    assert delta("pdmesh_kvstore_transfer_seconds_count", direction="out") == 2
    assert after["pdmesh_kvstore_hit_ratio[]"] > 0
    # One span per call and one for the Put's blocks arriving, with what moved.
    deadline = time.monotonic() + 10
    names = {"kvstore.lookup", "kvstore.put", "kvstore.receive", "kvstore.get"}
    while not names <= {s.name for s in stores.spans.spans} and time.monotonic() < deadline:
        time.sleep(0.1)
    received = {s.name: s for s in stores.spans.spans}
    assert received["kvstore.receive"].attributes["pdmesh.kv.bytes"] == 5 * BLOCK_BYTES
    assert received["kvstore.get"].attributes["pdmesh.kvstore.blocks"] in (5, 3)
    assert received["kvstore.lookup"].attributes["pdmesh.kvstore.hits"] == 5


def test_a_hit_needs_the_tokens_of_every_block_up_to_it(stores: Stores) -> None:
    tokens = tokens_of(seed=2, blocks=4)

    async def run() -> list[int]:
        client = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=5)
        await publish(client, tokens)
        third = list(tokens)
        third[3 * GEOMETRY.block_size + 1] += 1  # block 3 differs
        first = [tokens[0] + 1, *tokens[1:]]  # block 0 differs: every later key differs too
        asks = [tokens, third, first, tokens + tokens_of(9, 1, extra=1), tokens[:14]]
        found = [await client.lookup(t) for t in asks]
        await client.close()
        return found

    assert asyncio.run(run()) == [4, 3, 0, 4, 3]


def test_eviction_is_least_recently_used_within_the_byte_budget_leaves_first(
    stores: Stores,
) -> None:
    a, b, c = tokens_of(10, 3), tokens_of(11, 2), tokens_of(12, 2)

    async def run() -> tuple[list[int], kvstore_pb2.KVStoreStats]:
        client = KVStoreClient(stores.small.address, GEOMETRY, timeout_s=5)
        await publish(client, a)  # 3 of the 4 blocks
        await publish(client, b)  # evicts a's last block, the leaf, not its root
        seen = [await client.lookup(b), await client.lookup(a)]  # `a` is now the most recent
        await publish(client, c)  # so b's 2 blocks go
        seen += [await client.lookup(t) for t in (a, b, c)]
        stats = await client.store_stats()
        await client.close()
        assert stats is not None
        return seen, stats

    seen, stats = asyncio.run(run())
    assert seen == [2, 2, 2, 0, 2]
    assert (stats.capacity_blocks, stats.blocks_held, stats.evictions) == (4, 4, 3)
    assert stats.bytes_held == 4 * BLOCK_BYTES and stats.blocks_stored == 7


def test_a_store_killed_mid_get_is_a_miss_at_once(stores: Stores) -> None:
    tokens, asker = tokens_of(30, 3), receiving(0, 4)
    # The asker's data plane behind a proxy that holds every byte: the store's push hangs.
    proxy = TcpProxy(int(asker.receiver.endpoint.rsplit(":", 1)[1]))
    proxy.stall()

    async def run() -> tuple[bool, float]:
        client = KVStoreClient(stores.doomed.address, GEOMETRY, fetch_timeout_s=20)
        await publish(client, tokens)
        spec = TransferSpec.new([0, 1, 2], head_start=0, num_heads=4)
        written = [asker.receiver.expect(spec, 30)]
        target = fetch_target(spec, [asker], f"tcp://127.0.0.1:{proxy.port}")
        fetch = asyncio.create_task(client.fetch(tokens, 0, 3, target, written))

        async def pinned() -> bool:
            stats = await client.store_stats()
            return stats is not None and stats.blocks_pinned == 3

        deadline = time.monotonic() + 10
        while not await pinned():  # the Get is under way: its blocks are pinned
            assert time.monotonic() < deadline, "the Get did not start"
            await asyncio.sleep(0.05)
        start = time.monotonic()
        stores.doomed.kill()
        ok = await fetch
        took = time.monotonic() - start
        assert written[0].cancelled(), "the receiver still expects the transfer"
        assert await client.lookup(tokens) == 0
        assert not client.publish(tokens, 0, pushes([], []))  # marked down: dropped at once
        await client.close()
        return ok, took

    try:
        ok, took = asyncio.run(run())
    finally:
        proxy.close()
        asker.close()
    # Well under the 20 s fetch timeout: the death itself ends the fetch.
    assert not ok and took < 8.0, f"a dead store took {took:.1f} s to become a miss"


class _Garbage(kvstore_pb2_grpc.KVStoreServicer):
    """A store that answers nonsense to everything."""

    async def Lookup(self, request, context):
        return kvstore_pb2.KVLookupReply(num_blocks=1000)

    async def Put(self, request, context):
        return kvstore_pb2.KVPutReply(
            transport="tcp", endpoint="tcp://127.0.0.1:9", transfer_id="xyz", token=b"t",
            first_block=0, num_blocks=50, timeout_ms=1000,
        )  # fmt: skip

    async def Get(self, request, context):
        return kvstore_pb2.KVGetReply(num_blocks=request.num_blocks + 1)


def test_garbage_answers_are_misses() -> None:
    tokens, asker = tokens_of(40, 3), receiving(0, 4)
    pushed: list[PutTarget] = []

    async def push(target: PutTarget) -> None:
        pushed.append(target)

    async def run() -> KVStoreClient:
        server = grpc.aio.server()
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(_Garbage(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = KVStoreClient(f"127.0.0.1:{port}", GEOMETRY, retry_after_s=0)
        assert await client.lookup(tokens) == 0
        assert await client.lookup([-1] * 8) == 0  # the caller's bug: a miss too, never raised
        assert client.publish(tokens, 0, push)
        await wait_for(lambda: client.stats.publishes == 1)
        spec = TransferSpec.new([0, 1, 2], head_start=0, num_heads=4)
        written = [asker.receiver.expect(spec, 30)]
        assert not await client.fetch(tokens, 0, 3, fetch_target(spec, [asker]), written)
        assert written[0].cancelled()
        await client.close()
        await server.stop(None)
        return client

    try:
        client = asyncio.run(run())
    finally:
        asker.close()
    assert pushed == [] and client.stats.failures == 4 and client.stats.fetch_misses == 1


def test_requests_that_do_not_fit_are_refused_naming_the_field(stores: Stores) -> None:
    tokens = tokens_of(50, 2)

    async def run() -> KVStoreClient:
        client = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=5)
        await publish(client, tokens)  # the store serves GEOMETRY from its first Put on
        await client.close()
        other = StoreGeometry(**{**GEOMETRY.__dict__, "num_kv_heads": 8})
        wrong = KVStoreClient(stores.main.address, other, retry_after_s=0)
        assert await wrong.lookup(tokens) == 0  # a miss, not an exception
        await wrong.close()
        return wrong

    assert asyncio.run(run()).stats.failures == 1
    geometry = GEOMETRY.to_pb()
    cases = [
        ("Lookup", kvstore_pb2.KVLookupRequest(token_ids=tokens), "INVALID_ARGUMENT", "geometry"),
        (
            "Put",
            kvstore_pb2.KVPutRequest(
                geometry=kvstore_pb2.KVGeometry(**{**GEOMETRY.__dict__, "model": "other"}),
                token_ids=tokens,
            ),
            "FAILED_PRECONDITION",
            "model 'other' (this store: 'test/kvstore')",
        ),
        (
            "Get",
            kvstore_pb2.KVGetRequest(
                geometry=geometry,
                token_ids=tokens,
                num_blocks=2,
                transfer_id="nope",
                token=bytes(16),
            ),
            "INVALID_ARGUMENT",
            "transfer_id",
        ),
        (
            "Get",
            kvstore_pb2.KVGetRequest(
                geometry=geometry,
                token_ids=tokens,
                num_blocks=2,
                transfer_id="a" * 32,
                token=bytes(16),
            ),
            "INVALID_ARGUMENT",
            "endpoints",
        ),
    ]
    with grpc.insecure_channel(stores.main.address) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        for method, request, code, words in cases:
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(request, timeout=5)
            assert e.value.code().name == code and words in e.value.details(), e.value.details()


def test_health_reflection_and_a_client_without_torch(stores: Stores) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    from pdmesh.healthcheck import SERVING, check

    assert check(stores.main.address)[0] == SERVING
    with grpc.insecure_channel(stores.main.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"pdmesh.v1.KVStore", "grpc.health.v1.Health"} <= services
    # The router may hold a client: it must not pull in torch or the KV plane.
    code = (
        "import sys; import pdmesh.kvstore_service.client; "
        "assert 'torch' not in sys.modules and 'pdmesh.kv_transfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pdmesh_up_kvstore_starts_one_before_the_workers() -> None:
    from pdmesh.cli import build_parser
    from pdmesh.mesh import plan_mesh

    parser = build_parser()
    specs = plan_mesh(parser.parse_args(["up", "--kvstore", "--kvstore-capacity-gib", "0.5"]))
    assert [s.name for s in specs] == ["kvstore", "prefill-0", "decode-0", "router"]
    args = parser.parse_args(specs[0].command[3:])
    assert (args.command, args.capacity_gib, f"{args.host}:{args.port}") == (
        "kvstore",
        0.5,
        specs[0].address,
    )
    assert specs[0].metrics == f"http://{args.host}:{args.metrics_port}/metrics"
    assert plan_mesh(parser.parse_args(["up"]))[0].name == "prefill-0"


def test_a_stalled_store_is_a_miss_within_the_timeout(stores: Stores) -> None:
    """Last: it stops the main store (SIGSTOP) and lets it go on afterwards."""
    tokens, asker = tokens_of(60, 2), receiving(0, 4)

    async def run() -> None:
        quick = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=5)
        await publish(quick, tokens)
        await quick.close()
        stores.main.proc.send_signal(signal.SIGSTOP)
        # retry_after_s=0: every call meets the stall and waits its own timeout, no longer.
        client = KVStoreClient(
            stores.main.address, GEOMETRY, timeout_s=0.3, fetch_timeout_s=1.0, retry_after_s=0
        )
        start = time.monotonic()
        assert await client.lookup(tokens) == 0
        assert time.monotonic() - start < 1.0
        spec = TransferSpec.new([0, 1], head_start=0, num_heads=4)
        written = [asker.receiver.expect(spec, 30)]
        start = time.monotonic()
        assert not await client.fetch(tokens, 0, 2, fetch_target(spec, [asker]), written)
        assert time.monotonic() - start < 2.0 and written[0].cancelled()
        start = time.monotonic()
        assert client.publish(tokens, 0, pushes([], []))  # queued: the caller never waits
        assert time.monotonic() - start < 0.05
        await wait_for(lambda: client.stats.failures == 3, timeout_s=2)
        await client.close()
        # After one failure a client leaves the store alone for a while: misses at once.
        shy = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=0.3, retry_after_s=30)
        assert await shy.lookup(tokens) == 0
        start = time.monotonic()
        assert await shy.lookup(tokens) == 0 and not shy.publish(tokens, 0, pushes([], []))
        assert time.monotonic() - start < 0.05 and shy.stats.skipped == 1
        await shy.close()
        stores.main.proc.send_signal(signal.SIGCONT)
        back = KVStoreClient(stores.main.address, GEOMETRY, timeout_s=5)
        assert await back.lookup(tokens) == 2  # nothing was lost
        await back.close()

    try:
        asyncio.run(run())
    finally:
        stores.main.proc.send_signal(signal.SIGCONT)
        asker.close()
