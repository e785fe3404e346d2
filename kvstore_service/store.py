"""The KV store itself: the geometry it serves, its index and its pool, and what Lookup, Put and
Get do with them (the gRPC edge, servicer.py, only converts and records).

The geometry is the first Put's (a store serves one model geometry; anything else is refused,
naming what differs), so `pdmesh kvstore` needs no model: the pool is sized from the byte budget
and the data plane bound when that Put arrives. Calls name blocks by tokens only: the keys are
derived here (index.block_keys), so an asker can never claim a key its tokens do not have.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from pdmesh.errors import FailedPrecondition, InvalidRequest, NotFound, Unavailable
from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.stats import TransferStats
from pdmesh.kvstore_service.config import KVStoreConfig
from pdmesh.kvstore_service.index import BlockIndex, BlockKey, Pinned, Reservation, block_keys
from pdmesh.kvstore_service.pool import BlockPool, block_nbytes
from pdmesh.kvstore_service.types import TRANSPORT, FetchTarget, StoreGeometry
from pdmesh.logger import get_logger

log = get_logger(__name__)
PUSH_THREADS = 4  # Gets gathering and staging blocks at once; more wait their turn


@dataclass(frozen=True)
class Looked:
    """A Lookup's answer: of `asked` full blocks, the leading `hits` are held; `mismatch`: the
    next one's key is held with other tokens (a hash collision)."""

    asked: int
    hits: int
    mismatch: bool


@dataclass(frozen=True)
class Served:
    """A Get's answer: the push's figures and the served blocks' own tokens (uint32 each)."""

    transfer: TransferStats
    tokens: bytes


@dataclass(frozen=True)
class PutDone:
    stored: int  # blocks new to the store (the others were held already, or orphaned)
    transfer: TransferStats


@dataclass(eq=False)
class Offer:
    """A Put's answer: push offered blocks [first_block, first_block + num_blocks) to `endpoint`
    as transfer `transfer_id` (num_blocks 0: nothing is wanted). `done` resolves once they are
    in (PutDone) or dropped (TransferError)."""

    first_block: int
    num_blocks: int = 0
    endpoint: str = ""
    transfer_id: str = ""
    token: bytes = field(default=b"", repr=False)
    timeout_s: float = 0.0
    transport: str = TRANSPORT
    done: Future[PutDone] = field(default_factory=Future)


@dataclass
class StoreStats:
    """Counters since start and the state now; fields as in the proto's KVStoreStats."""

    capacity_bytes: int = 0
    bytes_held: int = 0
    capacity_blocks: int = 0
    blocks_held: int = 0
    blocks_pinned: int = 0
    blocks_filling: int = 0
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    token_mismatches: int = 0
    puts: int = 0
    puts_failed: int = 0
    blocks_stored: int = 0
    bytes_in: int = 0
    gets: int = 0
    gets_failed: int = 0
    blocks_served: int = 0
    bytes_out: int = 0
    evictions: int = 0
    geometry: StoreGeometry | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


class KVStore:
    """Callers may rely on: every method is thread-safe (`get` is awaited on an event loop);
    requests naming another geometry raise FailedPrecondition, bad fields InvalidRequest;
    a Get pushes every block asked for or none (NotFound); a block is never evicted while a
    Get reads it, nor visible to lookups before its Put's transfer completed."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards the pool's creation and the counters
        self._pool: BlockPool | None = None
        self._index: BlockIndex | None = None
        self._block_nbytes = 0
        self._counts = StoreStats(capacity_bytes=config.capacity_bytes)
        self._pushers = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="pdmesh-kvstore-push")

    # -- Lookup ----------------------------------------------------------------------------------
    def lookup(self, geometry: StoreGeometry, token_ids: Sequence[int]) -> Looked:
        _, index = self._serving(geometry, adopt=False)
        keys = block_keys(token_ids, geometry.block_size)
        found = index.match(keys) if index is not None else None
        hits = found.hits if found else 0
        mismatch = bool(found and found.mismatch)
        with self._lock:
            c = self._counts
            c.lookups += 1
            c.lookup_blocks += len(keys)
            c.hit_blocks += hits
            c.token_mismatches += mismatch
        return Looked(len(keys), hits, mismatch)

    # -- Put -------------------------------------------------------------------------------------
    def put(self, geometry: StoreGeometry, token_ids: Sequence[int], first_block: int) -> Offer:
        """Reserve room for the offered blocks the store lacks. Only blocks whose whole prefix
        is held or comes along are taken (others no lookup could reach): from the first block
        not held, when that is within the offer."""
        pool, index = self._serving(geometry, adopt=True)
        assert pool is not None and index is not None
        keys = block_keys(token_ids, geometry.block_size)
        if first_block > len(keys):
            raise InvalidRequest(
                f"first_block {first_block} is beyond the {len(keys)} full blocks of token_ids.",
                "first_block",
            )
        held = index.match(keys).hits  # refreshes the prefix, so room is not made by evicting it
        if held < first_block:
            return Offer(first_block)
        reservation = index.reserve(keys[held:])
        if not reservation.slots:
            return Offer(held)
        try:
            spec, arrival = pool.expect(reservation.slots, self.config.put_timeout_s)
        except BaseException:
            index.release(reservation)
            raise
        offer = Offer(
            held,
            len(reservation.slots),
            pool.endpoint,
            spec.transfer_id,
            spec.token,
            self.config.put_timeout_s,
        )
        arrival.add_done_callback(lambda f: self._arrived(index, reservation, offer, f))
        return offer

    def _arrived(
        self, index: BlockIndex, reservation: Reservation, offer: Offer, f: Future[TransferStats]
    ) -> None:
        """A Put's transfer ended (a receiver thread): keep its blocks or free their slots."""
        try:
            transfer = f.result()
        except BaseException as e:  # timed out, cancelled, receiver closed
            index.release(reservation)
            with self._lock:
                self._counts.puts_failed += 1
            offer.done.set_exception(e if isinstance(e, TransferError) else TransferError(str(e)))
            return
        stored = index.commit(reservation)
        with self._lock:
            c = self._counts
            c.puts += 1
            c.blocks_stored += stored
            c.bytes_in += transfer.bytes
        offer.done.set_result(PutDone(stored, transfer))

    # -- Get -------------------------------------------------------------------------------------
    async def get(
        self,
        geometry: StoreGeometry,
        token_ids: Sequence[int],
        first_block: int,
        num_blocks: int,
        target: FetchTarget,
        timeout_s: float,
    ) -> Served:
        """Push blocks [first_block, first_block + num_blocks) of `token_ids` into `target`."""
        try:
            pool, index = self._serving(geometry, adopt=False)
            keys = block_keys(token_ids, geometry.block_size)
            if num_blocks < 1 or first_block + num_blocks > len(keys):
                raise InvalidRequest(
                    f"blocks [{first_block}, {first_block + num_blocks}) are not within the "
                    f"{len(keys)} full blocks of token_ids.",
                    "num_blocks",
                )
            self._check_endpoints(geometry, target)
            wanted = keys[first_block : first_block + num_blocks]
            pinned = index.pin(wanted) if index is not None else None
            if pool is None or pinned is None:
                raise NotFound(_not_held(index, wanted))
            stats = await self._push(pool, index, pinned, target, timeout_s)
        except BaseException:
            with self._lock:
                self._counts.gets_failed += 1
            raise
        with self._lock:
            c = self._counts
            c.gets += 1
            c.blocks_served += num_blocks
            c.bytes_out += stats.bytes
        return Served(stats, pinned.tokens)

    async def _push(
        self,
        pool: BlockPool,
        index: BlockIndex,
        pinned: Pinned,
        target: FetchTarget,
        timeout_s: float,
    ) -> TransferStats:
        def push() -> TransferStats:
            try:
                return pool.push(pinned.slots, target, timeout_s)
            finally:
                index.unpin(pinned)  # here, not on the loop: only once nothing reads the slots

        job = self._pushers.submit(push)
        # A job cancelled before it started (the Get went away) never runs its `finally`.
        job.add_done_callback(lambda j: index.unpin(pinned) if j.cancelled() else None)
        try:
            return await asyncio.wrap_future(job)
        except TransferError as e:
            raise Unavailable(f"the KV store could not push the blocks: {e}") from None

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._lock:
            out = StoreStats(**{f.name: getattr(self._counts, f.name) for f in fields(StoreStats)})
            index, pool = self._index, self._pool
        if index is not None and pool is not None:
            s = index.stats()
            out.geometry = pool.geometry
            out.capacity_blocks = s.capacity_blocks
            out.blocks_held, out.blocks_pinned = s.blocks_held, s.blocks_pinned
            out.blocks_filling, out.evictions = s.blocks_filling, s.evictions
            out.bytes_held = s.blocks_held * self._block_nbytes
        return out

    def close(self) -> None:
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.close()  # open Puts fail, and their slots are released
        self._pushers.shutdown(wait=False, cancel_futures=True)

    # -- the geometry ----------------------------------------------------------------------------
    def _serving(
        self, geometry: StoreGeometry, adopt: bool
    ) -> tuple[BlockPool | None, BlockIndex | None]:
        """The pool and index for `geometry`: created for the first Put's, refused for another."""
        with self._lock:
            pool = self._pool
            if pool is not None:
                diff = pool.geometry.mismatch(geometry)
                if diff:
                    raise FailedPrecondition(
                        f"this KV store serves another model geometry: {diff}. A store serves "
                        "one model geometry (its first Put's): use another store for this model."
                    )
                return pool, self._index
            if not adopt:
                return None, None
            nbytes = block_nbytes(geometry)
            capacity = self.config.capacity_bytes // nbytes
            if capacity < 1:
                raise FailedPrecondition(
                    f"one block of this geometry is {nbytes} bytes, above the store's capacity "
                    f"of {self.config.capacity_bytes} bytes: raise --capacity-gib."
                )
            try:
                pool = BlockPool(
                    geometry, capacity, self.config.data_bind, self.config.data_advertise
                )
            except ValueError as e:  # the data plane could not bind
                raise Unavailable(f"the KV store's data plane is down: {e}") from None
            self._pool, self._index, self._block_nbytes = pool, BlockIndex(capacity), nbytes
        log.info(
            "KV store serves %s: %d blocks of %d bytes (%.2f GiB), data plane %s",
            geometry,
            capacity,
            nbytes,
            capacity * nbytes / (1 << 30),
            pool.endpoint,
        )
        return pool, self._index

    @staticmethod
    def _check_endpoints(geometry: StoreGeometry, target: FetchTarget) -> None:
        if not target.endpoints:
            raise InvalidRequest("endpoints must name at least one receiver.", "endpoints")
        addresses = [e.address for e in target.endpoints]
        if len(set(addresses)) != len(addresses):
            raise InvalidRequest("endpoints name one receiver twice.", "endpoints")
        for i, e in enumerate(target.endpoints):
            heads = e.num_heads >= 1 and e.head_start + e.num_heads <= geometry.num_kv_heads
            layers = e.layer_start + e.num_layers <= geometry.num_layers
            if not (heads and layers):
                raise InvalidRequest(
                    f"endpoints[{i}] holds heads [{e.head_start}, {e.head_start + e.num_heads}) "
                    f"and layers [{e.layer_start}, {e.layer_start + e.num_layers}), outside the "
                    f"model's {geometry.num_kv_heads} KV heads and {geometry.num_layers} layers.",
                    f"endpoints[{i}]",
                )


def _not_held(index: BlockIndex | None, wanted: list[BlockKey]) -> str:
    held = index.match(wanted).hits if index is not None else 0
    return (
        f"block {held} of the {len(wanted)} asked for is not held (evicted, or never stored): "
        "compute it."
    )
