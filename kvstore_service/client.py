"""What a worker (or the router) calls to use a KV store: `KVStoreClient`.

Read-through: `lookup(prompt)` says how many leading full blocks the store holds; the worker
expects a transfer into its own blocks for those it lacks (each rank's receiver, one spec) and
`fetch`es them. Write-behind: `publish(prompt, first_block, push)` queues blocks the worker
computed; a background task asks the store which run it wants (`put_target`) and calls `push`,
which moves them with the worker's own KV senders (`pusher.py` for one rank's cache).

Every failure is a miss: a store that is down, stalls, refuses, or answers something that does
not make sense costs a recompute, never a request. After a failure the client stops calling the
store for `retry_after_s` (doubling up to RETRY_MAX_S while failures repeat), answering "miss" at
once, so a dead or stalled store does not add its timeout to every request. Torch-free and free
of the KV plane: any process may hold one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc

from pdmesh.errors import InvalidRequest
from pdmesh.kvstore_service.types import FetchTarget, PutTarget, StoreGeometry
from pdmesh.logger import get_logger
from pdmesh.serving.auth import bearer_metadata
from pdmesh.serving.grpc_server import channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import kvstore_pb2, kvstore_pb2_grpc

log = get_logger(__name__)

Push = Callable[[PutTarget], Awaitable[None]]  # moves a Put's blocks; raises when it could not
RETRY_MAX_S = 30.0
M = TypeVar("M")
# Answers that say nothing about the store's health: the blocks went (evicted between a lookup
# and a get), or the caller asked wrongly (logged; a bug of the caller's).
_NOT_A_STORE_FAILURE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


@dataclass
class ClientStats:
    """What a client did since it was made (a snapshot: `KVStoreClient.stats`)."""

    lookups: int = 0
    lookup_blocks: int = 0  # full blocks asked about
    hit_blocks: int = 0  # of those, held by the store
    fetches: int = 0  # every block written into the caller's receivers
    fetched_blocks: int = 0
    fetch_misses: int = 0  # a fetch that failed: the caller computes those blocks
    token_mismatches: int = 0  # fetches whose reply named other tokens (misses too)
    publishes: int = 0  # pushed, or nothing the store wanted
    published_blocks: int = 0
    publishes_dropped: int = 0  # queue full, client closed, store marked down, or failed
    failures: int = 0  # calls that failed: down, stalled, refused, garbage
    skipped: int = 0  # calls not made: the store was marked down


class KVStoreClient:
    """Callers may rely on: no method raises for anything the store or the network does, and
    none waits longer than its timeout (`timeout_s` for lookups and Put offers, `fetch_timeout_s`
    for fetches; a publish's push has the store's put timeout); `lookup` returns the leading
    blocks held (0 on any failure); `fetch` returns True only when the store pushed every block,
    its reply names exactly the tokens asked for (a store serving other blocks is a miss) and,
    given the receivers' futures as `written`, each of them resolved, and on False it has
    cancelled them, so no frame of that transfer is written any more and the blocks may be
    reused; `publish` never blocks, may be called from any thread, and returns False when it
    dropped the work (the queue of `max_pending` offers is full, the store is marked down, the
    client is closed). Build it on the event loop that calls its coroutines; call `close` there.
    """

    def __init__(
        self,
        target: str,
        geometry: StoreGeometry,
        *,
        timeout_s: float = 0.5,
        fetch_timeout_s: float = 10.0,
        retry_after_s: float = 1.0,
        max_pending: int = 64,
        tls: TLSConfig | None = None,
        api_key: str | None = None,
    ) -> None:
        if not (timeout_s > 0 and fetch_timeout_s > 0 and retry_after_s >= 0 and max_pending > 0):
            raise ValueError(
                "KVStoreClient: timeout_s, fetch_timeout_s and max_pending must be positive "
                "and retry_after_s not negative."
            )
        self.target = target
        self.geometry = geometry
        self.timeout_s = timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_after_s = retry_after_s
        self.max_pending = max_pending
        self._geometry_pb = geometry.to_pb()
        self._metadata = bearer_metadata(api_key)
        self._channel = channel(target, tls)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # guards the counters, `_pending` and `_closed`
        self._counts = ClientStats()
        self._pending = 0
        self._closed = False
        self._down_until = 0.0  # time.monotonic() before which the store is not called
        self._backoff = retry_after_s
        self._queue: asyncio.Queue[tuple[list[int], int, Push]] = asyncio.Queue()
        self._publisher = self._loop.create_task(self._publish_forever())

    # -- read-through ----------------------------------------------------------------------------
    async def lookup(self, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of `token_ids` the store holds (0: a miss, or failure)."""
        full = len(token_ids) // self.geometry.block_size
        self._count(lookups=1, lookup_blocks=full)
        if not full or self._skip():
            return 0
        try:
            request = _build(
                kvstore_pb2.KVLookupRequest,
                geometry=self._geometry_pb,
                token_ids=token_ids[: full * self.geometry.block_size],
            )
            reply = await self._stub.Lookup(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
            if not 0 <= reply.num_blocks <= full:
                raise _garbage(f"{reply.num_blocks} blocks held of the {full} asked about")
        except Exception as e:
            self._failed("Lookup", e)
            return 0
        self._succeeded()
        self._count(hit_blocks=reply.num_blocks)
        return reply.num_blocks

    async def fetch(
        self,
        token_ids: Sequence[int],
        first_block: int,
        num_blocks: int,
        target: FetchTarget,
        written: Sequence[Future] = (),
    ) -> bool:
        """Have the store push blocks [first_block, first_block + num_blocks) of `token_ids`
        into the transfer `target` names (its receivers expect it already: its block j is block
        first_block + j). `written`: those receivers' futures, when in this process."""
        ok = False
        try:
            ok = await self._fetch(token_ids, first_block, num_blocks, target, written)
        finally:
            if not ok:
                for future in written:
                    future.cancel()  # a receiver then drops the transfer's frames
        if ok:
            self._count(fetches=1, fetched_blocks=num_blocks)
        else:
            self._count(fetch_misses=1)
        return ok

    async def _fetch(
        self,
        token_ids: Sequence[int],
        first_block: int,
        num_blocks: int,
        target: FetchTarget,
        written: Sequence[Future],
    ) -> bool:
        if self._skip():
            return False
        deadline = time.monotonic() + self.fetch_timeout_s
        try:
            request = _build(
                kvstore_pb2.KVGetRequest,
                geometry=self._geometry_pb,
                token_ids=token_ids[: (first_block + num_blocks) * self.geometry.block_size],
                first_block=first_block,
                num_blocks=num_blocks,
                transfer_id=target.transfer_id,
                token=target.token,
                endpoints=[e.to_pb() for e in target.endpoints],
                timeout_ms=max(1, int(self.fetch_timeout_s * 1000)),
            )
            reply = await self._stub.Get(
                request, timeout=self.fetch_timeout_s, metadata=self._metadata
            )
            if reply.num_blocks != num_blocks:
                raise _garbage(f"{reply.num_blocks} blocks pushed of the {num_blocks} asked for")
            bs = self.geometry.block_size
            end = (first_block + num_blocks) * bs
            if list(reply.token_ids) != list(token_ids[first_block * bs : end]):
                # Not the blocks asked for: whatever it wrote into the receivers is not used.
                self._count(token_mismatches=1)
                raise _garbage("blocks of other tokens")
            if written:
                waits = [asyncio.wrap_future(f) for f in written]
                await asyncio.wait_for(asyncio.gather(*waits), deadline - time.monotonic())
        except Exception as e:
            self._failed("Get", e)
            return False
        self._succeeded()
        return True

    # -- write-behind ----------------------------------------------------------------------------
    def publish(self, token_ids: Sequence[int], first_block: int, push: Push) -> bool:
        """Queue full blocks [first_block, ...) of `token_ids` for the store; `push` is awaited
        on this client's loop with where to push which of them. False: dropped now."""
        with self._lock:
            if self._closed or self._pending >= self.max_pending or self._down():
                self._counts.publishes_dropped += 1
                return False
            self._pending += 1
        job = (list(token_ids), first_block, push)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, job)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._pending -= 1
                self._counts.publishes_dropped += 1
            return False
        return True

    async def put_target(self, token_ids: Sequence[int], first_block: int) -> PutTarget | None:
        """Offer full blocks [first_block, ...) of `token_ids`: where to push the run the store
        wants, or None (it wants none, or the offer failed)."""
        full = len(token_ids) // self.geometry.block_size
        if first_block >= full or self._skip():
            return None
        try:
            request = _build(
                kvstore_pb2.KVPutRequest,
                geometry=self._geometry_pb,
                token_ids=token_ids[: full * self.geometry.block_size],
                first_block=first_block,
            )
            reply = await self._stub.Put(request, timeout=self.timeout_s, metadata=self._metadata)
            target = PutTarget.from_pb(reply, first_block, full) if reply.num_blocks else None
        except Exception as e:
            self._failed("Put", e)
            return None
        self._succeeded()
        return target

    async def _publish_forever(self) -> None:
        while True:
            tokens, first_block, push = await self._queue.get()
            try:
                pushed = await self._publish_one(tokens, first_block, push)
                self._count(publishes=1, published_blocks=pushed)
            except Exception as e:  # the push failed: the store drops the partial transfer
                self._failed("push", e)
                self._count(publishes_dropped=1)
            finally:
                with self._lock:
                    self._pending -= 1

    async def _publish_one(self, tokens: list[int], first_block: int, push: Push) -> int:
        target = await self.put_target(tokens, first_block)
        if target is None:
            return 0
        await asyncio.wait_for(push(target), target.timeout_s)
        return target.num_blocks

    # -- the rest --------------------------------------------------------------------------------
    async def store_stats(self) -> kvstore_pb2.KVStoreStats | None:
        """The store's own figures (None when it does not answer)."""
        try:
            return await self._stub.GetStats(
                kvstore_pb2.KVStoreStatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except Exception as e:
            self._failed("GetStats", e)
            return None

    @property
    def stats(self) -> ClientStats:
        with self._lock:
            return replace(self._counts)

    async def close(self) -> None:
        """Drop queued publishes and close the channel. Idempotent."""
        with self._lock:
            self._closed = True
        self._publisher.cancel()
        await asyncio.gather(self._publisher, return_exceptions=True)
        while not self._queue.empty():
            self._queue.get_nowait()
            self._count(publishes_dropped=1)
        await self._channel.close()

    # -- failures --------------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + n)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _skip(self) -> bool:
        if self._down():
            self._count(skipped=1)
            return True
        return False

    def _succeeded(self) -> None:
        self._backoff = self.retry_after_s

    def _failed(self, call: str, e: Exception) -> None:
        self._count(failures=1)
        code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
        if code in _NOT_A_STORE_FAILURE or isinstance(e, _CallerError):
            log.log(
                logging.DEBUG if code is grpc.StatusCode.NOT_FOUND else logging.WARNING,
                "KV store %s %s: %s",
                self.target,
                call,
                e.details() if isinstance(e, grpc.aio.AioRpcError) else e,
            )
            return
        first = not self._down()
        self._down_until = time.monotonic() + self._backoff
        if first:
            what = f"{code.name}: {e.details()}" if code else f"{type(e).__name__}: {e}"
            log.warning(
                "KV store %s failed (%s %s); treated as a miss, not called for %.1f s",
                self.target,
                call,
                what,
                self._backoff,
            )
        self._backoff = min(RETRY_MAX_S, self._backoff * 2)


async def store_geometry(
    target: str,
    *,
    timeout_s: float = 0.5,
    tls: TLSConfig | None = None,
    api_key: str | None = None,
) -> StoreGeometry | None:
    """The geometry the store at `target` serves (set by its first Put), or None: none yet, or
    no answer. For a process that does not know the model's KV (the router) before it builds
    a client to look prompts up."""
    ch = channel(target, tls)
    try:
        stats = await kvstore_pb2_grpc.KVStoreStub(ch).GetStats(
            kvstore_pb2.KVStoreStatsRequest(), timeout=timeout_s, metadata=bearer_metadata(api_key)
        )
        return StoreGeometry.from_pb(stats.geometry) if stats.HasField("geometry") else None
    except Exception as e:  # down, refusing, or a geometry that does not make sense
        log.debug("KV store %s has no geometry to give: %s", target, e)
        return None
    finally:
        await ch.close()


class _CallerError(ValueError):
    """A call the caller got wrong (token ids that are no uint32, ...): a miss, logged, and no
    sign of the store's health."""


def _build(message: type[M], **fields: Any) -> M:
    try:
        return message(**fields)
    except (TypeError, ValueError) as e:
        raise _CallerError(f"cannot build {message.__name__}: {e}") from None


def _garbage(what: str) -> InvalidRequest:
    return InvalidRequest(f"the store answered {what}.")
