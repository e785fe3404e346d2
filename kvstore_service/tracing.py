"""The KV store's spans, when tracing is on (pdmesh.observability.tracing):

    (the Lookup, Put or Get call, by the gRPC instrumentation; child of the asker's span)
      kvstore.lookup    blocks asked, leading blocks held, a token mismatch
      kvstore.put       the offer: blocks offered, the run wanted, the transfer id
      kvstore.get       blocks pushed, bytes, seconds, the receivers
    kvstore.receive     a Put's blocks arriving, Put answered -> every page in: blocks new to
                        the store, bytes, seconds; child of the Put call (it ends after it)

All are built from timestamps once a call or transfer is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from opentelemetry import trace

from pdmesh.kv_transfer.stats import TransferStats
from pdmesh.kvstore_service.store import Looked, Offer, PutDone
from pdmesh.kvstore_service.types import RankEndpoint
from pdmesh.observability import tracing


def record_lookup(start_ns: int, looked: Looked | None, error: BaseException | None) -> None:
    if not tracing.enabled():
        return
    attributes = {}
    if looked is not None:
        attributes = {
            "pdmesh.kvstore.blocks": looked.asked,
            "pdmesh.kvstore.hits": looked.hits,
            "pdmesh.kvstore.token_mismatch": looked.mismatch,
        }
    tracing.record_span("kvstore.lookup", start_ns, time.time_ns(), None, attributes, error)


Recorder = Callable[[PutDone | None, BaseException | None], None]


def record_put(
    start_ns: int, offered: int, offer: Offer | None, error: BaseException | None
) -> Recorder | None:
    """The offer's span; returns what records its arrival (None when tracing is off or nothing
    is to arrive)."""
    if not tracing.enabled():
        return None
    attributes: dict[str, int | str] = {"pdmesh.kvstore.blocks_offered": offered}
    if offer is not None:
        attributes |= {
            "pdmesh.kvstore.first_block": offer.first_block,
            "pdmesh.kvstore.blocks": offer.num_blocks,
            "pdmesh.kv.transfer_id": offer.transfer_id,
        }
    end_ns = time.time_ns()
    tracing.record_span("kvstore.put", start_ns, end_ns, None, attributes, error)
    if offer is None or not offer.num_blocks:
        return None
    call = tracing.context_of(trace.get_current_span())

    def arrived(done: PutDone | None, failed: BaseException | None) -> None:
        attributes: dict[str, int | float | str] = {
            "pdmesh.kv.transfer_id": offer.transfer_id,
            "pdmesh.kvstore.blocks": offer.num_blocks,
        }
        if done is not None:
            attributes |= {
                "pdmesh.kvstore.blocks_stored": done.stored,
                "pdmesh.kv.bytes": done.transfer.bytes,
                "pdmesh.kv.seconds": done.transfer.seconds,
            }
        tracing.record_span("kvstore.receive", end_ns, time.time_ns(), call, attributes, failed)

    return arrived


def record_get(
    start_ns: int,
    num_blocks: int,
    endpoints: Sequence[RankEndpoint],
    sent: TransferStats | None,
    error: BaseException | None,
) -> None:
    if not tracing.enabled():
        return
    attributes: dict[str, int | float | str] = {
        "pdmesh.kvstore.blocks": num_blocks,
        "pdmesh.kv.destinations": ",".join(e.address for e in endpoints),
    }
    if sent is not None:
        attributes |= {
            "pdmesh.kv.bytes": sent.bytes,
            "pdmesh.kv.frames": sent.frames,
            "pdmesh.kv.seconds": sent.seconds,
        }
    tracing.record_span("kvstore.get", start_ns, time.time_ns(), None, attributes, error)
