"""The prefill worker's spans, when tracing is on (pdmesh.observability.tracing):

    (the Prefill call, by the gRPC instrumentation; child of the decode worker's call)
      prefill.queue     call received -> its first forward step
      prefill.forward   first forward step -> first token (prompt and cached tokens)
    kv.send             first layer pushed -> every frame acknowledged: bytes, layers, blocks,
                        seconds; child of the decode worker's kv.receive (its context comes in the
                        KV target), linked to the Prefill call

All are built from timestamps once the call is over, on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace

from pdmesh.kv_transfer import TransferStats
from pdmesh.observability import tracing

if TYPE_CHECKING:
    from pdmesh.prefill_service.worker import PrefillTask


def record_prefill(
    task: PrefillTask,
    num_layers: int,
    received_ns: int,
    forward_ns: int,
    first_token_ns: int,
    sent: Sequence[TransferStats],
    error: BaseException | None = None,
) -> None:
    """Spans of one Prefill call; `forward_ns` 0: it never ran, `first_token_ns` 0: it failed
    before its first token."""
    if not tracing.enabled():
        return
    now = time.time_ns()
    call = trace.get_current_span()
    tracing.record_span(
        "prefill.queue",
        received_ns,
        forward_ns or now,
        attributes={"pdmesh.request_id": task.request_id},
        error=None if forward_ns else error,
    )
    if not forward_ns:
        return
    tracing.record_span(
        "prefill.forward",
        forward_ns,
        first_token_ns or now,
        attributes={"pdmesh.prompt_tokens": len(task.prompt)},
        error=None if first_token_ns else error,
    )
    receiver = tracing.extract(task.target.trace_context)
    tracing.record_span(
        "kv.send",
        forward_ns,
        now,
        parent=receiver,  # None: under the Prefill call
        attributes={
            "pdmesh.kv.transfer_id": task.target.transfer_id,
            "pdmesh.kv.bytes": sum(s.bytes for s in sent),
            "pdmesh.kv.frames": sum(s.frames for s in sent),
            "pdmesh.kv.seconds": max((s.seconds for s in sent), default=0.0),
            "pdmesh.kv.blocks": task.target.num_blocks,
            "pdmesh.kv.layers": num_layers,
            "pdmesh.kv.destinations": ",".join(d.address for d in task.target.endpoints),
        },
        error=error,
        links=[trace.Link(call.get_span_context())] if receiver is not None else (),
    )
