"""What the KV store tests share: one model geometry, ranks of a worker (a cache of some KV heads
with a real tcp sender or receiver), prompts, and waiting for the store's client."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.kv_transfer import PageGeometry, TransferSpec
from pdmesh.kv_transfer.tcp_receiver import TcpReceiver
from pdmesh.kv_transfer.tcp_sender import TcpSender
from pdmesh.kvstore_service.client import KVStoreClient
from pdmesh.kvstore_service.pusher import cache_pusher
from pdmesh.kvstore_service.types import FetchTarget, PutTarget, RankEndpoint, StoreGeometry

GEOMETRY = StoreGeometry("test/kvstore", "bfloat16", num_layers=3, num_kv_heads=4, head_dim=8,
                         block_size=4)  # fmt: skip
BLOCK_BYTES = 3 * 2 * 4 * 4 * 8 * 2  # layers x (K, V) x tokens x KV heads x head dim x bf16
GIB = 1 << 30


# -- ranks of a worker: a cache of some KV heads, with a sender or a receiver -------------------
@dataclass
class Rank:
    heads: slice
    cache: torch.Tensor  # [layers, 2, blocks, block_size, heads, head_dim]
    sender: TcpSender | None = None
    receiver: TcpReceiver | None = None

    def close(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()


def _pages(head_start: int, heads: int) -> PageGeometry:
    g = GEOMETRY
    return PageGeometry(g.num_layers, g.block_size, heads, head_start, g.head_dim, torch.bfloat16)


def sending(head_start: int, heads: int, seed: int) -> Rank:
    pages = _pages(head_start, heads)
    cache = torch.randn(pages.cache_shape(10), generator=torch.Generator().manual_seed(seed))
    return Rank(slice(head_start, head_start + heads), cache.bfloat16(), sender=TcpSender(pages))


def receiving(head_start: int, heads: int) -> Rank:
    pages = _pages(head_start, heads)
    cache = torch.zeros(pages.cache_shape(8), dtype=torch.bfloat16)
    receiver = TcpReceiver(cache, pages, "tcp://127.0.0.1:0")
    return Rank(slice(head_start, head_start + heads), cache, receiver=receiver)


def fetch_target(spec: TransferSpec, ranks: list[Rank], address: str | None = None) -> FetchTarget:
    endpoints = tuple(
        RankEndpoint(address or r.receiver.endpoint, r.heads.start, r.heads.stop - r.heads.start)
        for r in ranks
        if r.receiver is not None
    )
    return FetchTarget(spec.transfer_id, spec.token, endpoints)


def pushes(ranks: list[Rank], block_ids: list[int]) -> Callable[[PutTarget], Awaitable[None]]:
    """Every rank of the publishing worker pushes its own heads to the same target."""
    each = [cache_pusher(r.sender, r.cache, block_ids) for r in ranks if r.sender is not None]

    async def push(target: PutTarget) -> None:
        await asyncio.gather(*(p(target) for p in each))

    return push


def tokens_of(seed: int, blocks: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(blocks * GEOMETRY.block_size + extra)]


async def wait_for(check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.02)


async def publish(client: KVStoreClient, tokens: list[int], seed: int = 0) -> None:
    """Publish every full block of `tokens` from one rank holding every head; wait until done."""
    rank, done = sending(0, GEOMETRY.num_kv_heads, seed), client.stats.publishes + 1
    try:
        ids = list(range(len(tokens) // GEOMETRY.block_size))
        assert client.publish(tokens, 0, pushes([rank], ids))
        await wait_for(lambda: client.stats.publishes == done)
    finally:
        rank.close()


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {
            s.name + str(sorted(s.labels.items())): s.value for f in families for s in f.samples
        }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# -- the tests ----------------------------------------------------------------------------------
