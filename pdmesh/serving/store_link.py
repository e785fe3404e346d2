"""A worker's use of a KV store (`--kvstore HOST:PORT`): read-through before a prompt is computed,
write-behind once it was. Both workers (prefill, and decode for the prompts it prefills itself)
hold one `StoreLink` on rank 0.

Design (the simplest one that is correct for both workers, with or without a host tier):

- **Read-through into the worker's own device blocks, through a receiver of its own.** The link
  binds one tcp KV receiver to the engine's cache (a prefill worker has no receiver otherwise, and
  a decode worker's may speak another transport). Before the request is added, the link asks the
  store how many leading full blocks of the prompt it holds (all but the last token, which is
  always computed); when that is more than the worker holds (device cache and host tier,
  `held_prefix_blocks`), it holds that many free device blocks (engine/external_prefix.py), has
  the store push blocks [held, hits) into them, and on success publishes them in the device
  prefix cache under their chained hashes, in the same engine-thread call that adds the request:
  the engine's normal prefix match then adopts them, tokens and parents checked block by block,
  as if this worker had computed them. The host tier's load path is not involved: a store hit
  costs one transfer straight into device blocks.
- **Trust nothing.** The store's Get reply names the tokens of the blocks it served; the client
  compares them with the prompt's and a difference is a miss (the blocks go back unpublished).
  Every store failure, stall (lookups 0.5 s, fetches `fetch_timeout_s`) or garbage answer is a
  miss and the prompt is computed; after a failure the client leaves the store alone for a while
  (client.py), so a dead store costs nothing per request.
- **Write-behind from a copy.** When a prompt's first token is out, the link copies the device
  blocks holding its full blocks beyond what the store was known to hold (one `index_select` on
  the engine thread, between steps) and queues a publish; the push reads the copy on a thread,
  so it never stalls a step and no later step can overwrite what it reads. A full queue drops the
  publish (the copy is let go).

For now only workers of one rank: the other ranks of a tensor- or pipeline-parallel worker hold
their own heads and layers, and would need to fetch and push them too (StoreLink refuses them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdmesh.engine.external_prefix import (
    check_single_rank,
    held_prefix_blocks,
    hold_blocks,
    publish_held,
    release_held,
    snapshot_prefix,
)
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.kv_transfer.base import TransferSpec
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.receive_connector import advertised
from pdmesh.kv_transfer.registry import create_receiver, create_sender
from pdmesh.kvstore_service.client import KVStoreClient, Push
from pdmesh.kvstore_service.pusher import push_blocks
from pdmesh.kvstore_service.types import FetchTarget, PutTarget, RankEndpoint, StoreGeometry
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.serving.engine_loop import EngineLoop
from pdmesh.serving.tls import TLSConfig

log = get_logger(__name__)


@dataclass(frozen=True)
class StoreOptions:
    """address: the store's gRPC HOST:PORT. timeout_s: a Lookup's or Put offer's limit;
    fetch_timeout_s: a Get's (the push into this worker included). data_host: where this
    worker's store receiver listens (a free port); advertise: the host the store pushes to
    (default: data_host)."""

    address: str
    timeout_s: float = 0.5
    fetch_timeout_s: float = 5.0
    data_host: str = "127.0.0.1"
    advertise: str | None = None

    def __post_init__(self) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--kvstore must be HOST:PORT of a KV store, got {self.address!r}.")
        if not (self.timeout_s > 0 and self.fetch_timeout_s > 0):
            raise ValueError("--kvstore-timeout and --kvstore-fetch-timeout must be > 0.")


@dataclass
class StoreFigures:
    """What the link did since start (WorkerStats' store_* fields)."""

    store_lookups: int = 0  # prompts looked up
    store_lookup_blocks: int = 0  # their full blocks (all but the last token)
    store_hit_blocks: int = 0  # blocks fetched from the store and published here
    store_hit_tokens: int = 0
    store_fetch_failures: int = 0  # fetches that failed or were refused: computed instead
    store_fetched_bytes: int = 0
    store_fetch_seconds: float = 0.0
    store_published_blocks: int = 0  # blocks pushed to the store
    store_published_bytes: int = 0
    store_publish_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Blocks fetched over prompt blocks looked up (the store's share of the prompts)."""
        return self.store_hit_blocks / max(1, self.store_lookup_blocks)


@dataclass(frozen=True)
class Fetched:
    """A read-through's outcome, to settle on the engine thread before the request is added."""

    first_block: int
    block_ids: list[int]
    ok: bool


class StoreLink:
    """Callers may rely on: build it on the event loop, after the engine; `read_through` never
    raises for anything the store does and returns None or a `Fetched` that `settle` must get
    (on the engine thread, before the request is added); `published` never blocks for long
    (engine thread); figures from any thread."""

    def __init__(
        self,
        options: StoreOptions,
        engine: LLMEngine,
        loop: EngineLoop,
        pages: PageGeometry,
        tls: TLSConfig | None = None,
    ) -> None:
        check_single_rank(engine, "--kvstore")
        self.options = options
        self.loop = loop
        self.block_size = bs = engine.config.block_size
        cache = engine.runner.kv_cache.data  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        layers, _, _, _, heads, head_dim = cache.shape
        self.geometry = StoreGeometry(
            str(engine.config.model),
            str(cache.dtype).removeprefix("torch."),
            layers,
            heads,
            head_dim,
            bs,
        )
        self.block_bytes = cache[:, :, :1].numel() * cache.element_size()
        self.pages = pages
        self.receiver = create_receiver("tcp", cache, pages, f"tcp://{options.data_host}:0")
        self.sender = create_sender("tcp", pages)
        self.endpoint = RankEndpoint(
            advertised(self.receiver.endpoint, options.advertise), pages.head_start, heads
        )
        self.client = KVStoreClient(
            options.address,
            self.geometry,
            timeout_s=options.timeout_s,
            fetch_timeout_s=options.fetch_timeout_s,
            tls=tls,
        )
        self._lock = threading.Lock()
        self._figures = StoreFigures()

    async def close(self) -> None:
        await self.client.close()
        self.receiver.close()
        self.sender.close()

    # -- read-through (event loop) ---------------------------------------------------------------
    async def read_through(self, prompt: Sequence[int]) -> Fetched | None:
        """Fetch the leading blocks of `prompt` the store holds beyond this worker's into held
        device blocks: None when there is nothing to fetch."""
        tokens = list(prompt)
        bs = self.block_size
        self._count(store_lookups=1, store_lookup_blocks=(len(tokens) - 1) // bs)
        span = _span("kvstore.lookup", {"pdmesh.prompt_tokens": len(tokens)})
        hits = await self.client.lookup(tokens[:-1])  # the last token is always computed
        _end(span, {"pdmesh.store_blocks": hits})
        if not hits:
            return None
        held, ids = await self.loop.acall(lambda e: self._hold(e, tokens, hits))
        if ids is None:
            return None
        try:
            ok = await self._fetch(tokens, held, ids)
        except BaseException:  # cancelled: the blocks go back, whatever comes
            self.loop.call(lambda e: release_held(e, ids))
            raise
        return Fetched(held, ids, ok)

    def _hold(
        self, engine: LLMEngine, prompt: list[int], hits: int
    ) -> tuple[int, list[int] | None]:
        held = held_prefix_blocks(engine, prompt)
        return held, hold_blocks(engine, hits - held) if hits > held else None

    async def _fetch(self, prompt: list[int], first: int, ids: list[int]) -> bool:
        spec = TransferSpec.new(ids, self.pages.head_start, self.pages.num_kv_heads)
        arrived = self.receiver.expect(spec, timeout=self.options.fetch_timeout_s)
        target = FetchTarget(spec.transfer_id, spec.token, (self.endpoint,))
        span = _span("kvstore.fetch", {"pdmesh.first_block": first, "pdmesh.blocks": len(ids)})
        start = time.perf_counter()
        ok = await self.client.fetch(prompt, first, len(ids), target, [arrived])
        seconds = time.perf_counter() - start
        if not ok:
            self.receiver.cancel(spec.transfer_id)
        _end(span, {"pdmesh.ok": ok}, None if ok else "the store's blocks did not come")
        if ok:
            nbytes = arrived.result().bytes
            self._count(store_fetched_bytes=nbytes, store_fetch_seconds=seconds)
        else:
            self._count(store_fetch_failures=1)
        return ok

    def settle(self, engine: LLMEngine, prompt: Sequence[int], fetched: Fetched | None) -> int:
        """Engine thread: publish the fetched blocks (or give them back); how many blocks the
        store is known to hold of `prompt` (what write-behind need not push)."""
        if fetched is None:
            return 0
        if not fetched.ok:
            release_held(engine, fetched.block_ids)
            return 0
        n = len(fetched.block_ids)
        publish_held(engine, list(prompt), fetched.first_block, fetched.block_ids)
        self._count(store_hit_blocks=n, store_hit_tokens=n * self.block_size)
        return fetched.first_block + n

    # -- write-behind (engine thread) ------------------------------------------------------------
    def published(self, engine: LLMEngine, prompt: Sequence[int], known_blocks: int) -> bool:
        """`prompt` was computed here: queue its full blocks beyond the first `known_blocks`
        (held by the store already) for the store, from a copy. False: nothing queued."""
        snap = snapshot_prefix(engine, list(prompt), known_blocks)
        if snap is None:
            return False
        n, copy = snap
        end = (known_blocks + n) * self.block_size
        return self.client.publish(
            list(prompt[:end]), known_blocks, self._pusher(copy, known_blocks)
        )

    def _pusher(self, copy: torch.Tensor, first_block: int) -> Push:
        """Pushes the run a Put target names from `copy`, whose block j is block first_block + j."""

        async def push(target: PutTarget) -> None:
            start = target.first_block - first_block
            run = list(range(start, start + target.num_blocks))
            span = _span("kvstore.publish", {"pdmesh.blocks": target.num_blocks})
            began = time.perf_counter()
            try:
                await asyncio.to_thread(push_blocks, target, self.sender, copy, run)
            except BaseException as e:
                _end(span, {}, e)
                raise
            _end(span, {})
            self._count(
                store_published_blocks=target.num_blocks,
                store_published_bytes=target.num_blocks * self.block_bytes,
                store_publish_seconds=time.perf_counter() - began,
            )

        return push

    # -- figures ---------------------------------------------------------------------------------
    def _count(self, **deltas: float) -> None:
        with self._lock:
            f = self._figures
            for name, v in deltas.items():
                setattr(f, name, getattr(f, name) + v)

    def figures(self) -> dict[str, float]:
        """WorkerStats' store_* fields (any thread)."""
        with self._lock:
            f = self._figures
            out = dict(vars(f))
            out["store_hit_rate"] = f.hit_rate
        return out


def _span(name: str, attributes: dict[str, object]) -> object | None:
    return tracing.start_span(name, attributes=attributes) if tracing.enabled() else None


def _end(span: object | None, attributes: dict[str, object], error: object = None) -> None:
    if span is None:
        return
    for k, v in attributes.items():
        span.set_attribute(k, v)  # type: ignore[attr-defined]
    tracing.end_span(span, error=error)  # type: ignore[arg-type]
