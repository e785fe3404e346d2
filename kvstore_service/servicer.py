"""The gRPC edge of the KV store (`pdmesh.v1.KVStore`): requests checked and converted, the store
called, replies built, metrics and spans recorded. Why these four calls:

- `Lookup(tokens) -> leading blocks held` is the read-through's cheap first step: a worker (or
  the router's policy) learns how much of a prompt it could fetch, and nothing moves yet.
- `Put(tokens, first_block) -> where to push which run` lets the store decide what it wants
  (not what it holds already, not what would exceed its budget or hang off nothing) before a
  byte moves; the worker then pushes with its own kv_transfer sender, every rank its own heads
  and layers, exactly as a prefill worker pushes to a decode worker. There is no commit call:
  the store takes the blocks in when its receiver saw every page, and drops them at the timeout.
- `Get(tokens, blocks, the asker's transfer)` inverts that: the asker's receivers expect a
  transfer (id, token, their block ids) and the store pushes into them, each rank its heads and
  layers; the reply comes once every frame was acknowledged, so a worker needs nothing more.
- `GetStats` for people and tests; Prometheus reads the same figures.

Every call names blocks by tokens; the store computes the keys (no hash travels).
"""

from __future__ import annotations

import time
from array import array
from concurrent.futures import Future

from pdmesh.errors import InvalidRequest
from pdmesh.kvstore_service.metrics import IN, OUT, KVStoreMetrics
from pdmesh.kvstore_service.store import KVStore, Offer, PutDone, StoreStats
from pdmesh.kvstore_service.tracing import Recorder, record_get, record_lookup, record_put
from pdmesh.kvstore_service.types import (
    FetchTarget,
    RankEndpoint,
    StoreGeometry,
    check_endpoint,
    check_transfer,
)
from pdmesh.v1 import kvstore_pb2, kvstore_pb2_grpc


def geometry_from_pb(
    req: kvstore_pb2.KVLookupRequest | kvstore_pb2.KVPutRequest | kvstore_pb2.KVGetRequest,
) -> StoreGeometry:
    if not req.HasField("geometry"):
        raise InvalidRequest("geometry is required: what the asker's blocks look like.", "geometry")
    return StoreGeometry.from_pb(req.geometry)


def target_from_pb(req: kvstore_pb2.KVGetRequest) -> FetchTarget:
    check_transfer("", req.transfer_id, req.token)
    endpoints = tuple(RankEndpoint.from_pb(e) for e in req.endpoints)
    for i, e in enumerate(endpoints):
        check_endpoint(f"endpoints[{i}].address", e.address)
    return FetchTarget(req.transfer_id, req.token, endpoints)


def offer_to_pb(offer: Offer) -> kvstore_pb2.KVPutReply:
    if not offer.num_blocks:
        return kvstore_pb2.KVPutReply(first_block=offer.first_block)
    return kvstore_pb2.KVPutReply(
        transport=offer.transport,
        endpoint=offer.endpoint,
        transfer_id=offer.transfer_id,
        token=offer.token,
        first_block=offer.first_block,
        num_blocks=offer.num_blocks,
        timeout_ms=max(1, int(offer.timeout_s * 1000)),
    )


def stats_to_pb(s: StoreStats) -> kvstore_pb2.KVStoreStats:
    fields = {k: v for k, v in vars(s).items() if k != "geometry"}
    pb = kvstore_pb2.KVStoreStats(**fields, hit_rate=s.hit_rate)
    if s.geometry is not None:
        pb.geometry.CopyFrom(s.geometry.to_pb())
    return pb


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: KVStore, metrics: KVStoreMetrics) -> None:
        self.store = store
        self.metrics = metrics

    async def Lookup(self, request, context):
        start, looked, error = time.time_ns(), None, None
        try:
            looked = self.store.lookup(geometry_from_pb(request), request.token_ids)
            return kvstore_pb2.KVLookupReply(num_blocks=looked.hits)
        except Exception as e:
            error = e
            raise
        finally:
            record_lookup(start, looked, error)

    async def Put(self, request, context):
        start, offer, error = time.time_ns(), None, None
        try:
            geometry = geometry_from_pb(request)
            offer = self.store.put(geometry, request.token_ids, request.first_block)
            return offer_to_pb(offer)
        except Exception as e:
            error = e
            raise
        finally:
            offered = len(request.token_ids) // max(1, request.geometry.block_size)
            arrived = record_put(start, offered - request.first_block, offer, error)
            if offer is not None and offer.num_blocks:
                offer.done.add_done_callback(lambda done: self._arrived(done, arrived))

    def _arrived(self, done: Future[PutDone], record: Recorder | None) -> None:
        """A Put's blocks arrived or were dropped (on a receiver thread)."""
        failed = done.exception()
        result = done.result() if failed is None else None
        if result is not None:
            self.metrics.transferred(IN, result.transfer.seconds)
        if record is not None:
            record(result, failed)

    async def Get(self, request, context):
        start, sent, error, target = time.time_ns(), None, None, None
        try:
            geometry = geometry_from_pb(request)
            target = target_from_pb(request)
            limit = self.store.config.get_timeout_s
            timeout = min(limit, request.timeout_ms / 1000) if request.timeout_ms else limit
            first, count = request.first_block, request.num_blocks
            served = await self.store.get(
                geometry, request.token_ids, first, count, target, timeout
            )
            sent = served.transfer
            self.metrics.transferred(OUT, sent.seconds)
            return kvstore_pb2.KVGetReply(
                num_blocks=request.num_blocks,
                bytes=sent.bytes,
                send_ns=int(sent.seconds * 1e9),
                token_ids=array("I", served.tokens),
            )
        except Exception as e:
            error = e
            raise
        finally:
            endpoints = target.endpoints if target is not None else ()
            record_get(start, request.num_blocks, endpoints, sent, error)

    async def GetStats(self, request, context):
        return stats_to_pb(self.store.stats())
