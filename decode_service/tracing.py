"""The decode worker's spans, when tracing is on (pdmesh.observability.tracing):

    decode.request    Submit received -> last token; child of the router's Submit call
      decode.queue      Submit received -> admitted by the engine thread
      decode.prefill    admitted -> first token (pdmesh.prefill.mode: remote or local)
      decode.generate   first token -> last token: token count, mean inter-token latency
                        (a summary: no span per token)
      kv.receive        transfer announced -> every block written: bytes, layers, blocks, seconds
      (the Prefill call to a prefill worker, by the gRPC instrumentation)

Only `decode.request` and `kv.receive` are open while the request runs; the rest are built from
the request's timestamps when it finishes, on the event loop, never on the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import Span

from pdmesh.decode_service.types import Delta, Submission
from pdmesh.kv_transfer import PageGeometry, TransferSpec, TransferStats
from pdmesh.observability import tracing


@dataclass
class _Open:
    span: Span
    submit_ns: int  # this worker's clock
    arrival_ns: int  # the router's, which the request's timings count from


class DecodeTraces:
    """Spans of the requests in flight; every method is a no-op when tracing is off."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def begin(self, sub: Submission) -> Span | None:
        """Open the request's span under the current (Submit) span; None when tracing is off."""
        if not tracing.enabled():
            return None
        now = time.time_ns()
        span = tracing.start_span(
            "decode.request",
            start_ns=now,
            attributes={
                "pdmesh.request_id": sub.request_id,
                "pdmesh.prompt_tokens": len(sub.prompt),
                "pdmesh.max_tokens": sub.params.max_tokens,
                "pdmesh.prefill_worker": sub.prefill_address or "",
            },
        )
        self._open[sub.request_id] = _Open(span, now, sub.arrival_ns or now)
        return span

    def refused(self, request_id: str, error: BaseException) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            tracing.end_span(entry.span, error=error)

    def moved(self, request_id: str, handle: str) -> None:
        """The request left this worker (it drains): with its KV (a handle) or to be recomputed."""
        entry = self._open.pop(request_id, None)
        if entry is not None:
            entry.span.set_attribute("pdmesh.moved", "migrate" if handle else "recompute")
            tracing.end_span(entry.span)

    def finished(self, d: Delta) -> None:
        """The request's last delta: record its phases and close its span (event loop)."""
        entry = self._open.pop(d.request_id, None) if self._open else None
        if entry is None or d.timings is None:
            return
        t, span, arrival = d.timings, entry.span, entry.arrival_ns
        admitted = arrival + t.queue_ns
        end = arrival + t.total_ns
        parent = tracing.context_of(span)
        tracing.record_span("decode.queue", entry.submit_ns, admitted, parent)
        completion = d.usage.completion_tokens if d.usage else 0
        if completion:
            first = arrival + t.first_token_ns
            tracing.record_span(
                "decode.prefill",
                admitted,
                first,
                parent,
                {
                    "pdmesh.prefill.mode": "remote" if t.disaggregated else "local",
                    "pdmesh.cached_prompt_tokens": d.usage.cached_prompt_tokens if d.usage else 0,
                },
            )
            itl_ms = (end - first) / 1e6 / (completion - 1) if completion > 1 else 0.0
            tracing.record_span(
                "decode.generate",
                first,
                end,
                parent,
                {"pdmesh.completion_tokens": completion, "pdmesh.mean_itl_ms": itl_ms},
            )
            span.set_attribute("pdmesh.ttft_ms", t.first_token_ns / 1e6)
        span.set_attribute("pdmesh.completion_tokens", completion)
        span.set_attribute("pdmesh.finish_reason", d.finish_reason or "")
        if d.usage is not None:
            span.set_attribute("pdmesh.cached_prompt_tokens", d.usage.cached_prompt_tokens)
        error = (d.error_message or "failed") if d.error_status else None
        tracing.end_span(span, max(end, entry.submit_ns), error)

    # -- the KV transfer of a remote prefill (inside the request's span) -------------------------
    @staticmethod
    def transfer_started(spec: TransferSpec, geometry: PageGeometry, transport: str) -> Span | None:
        if not tracing.enabled():
            return None
        return tracing.start_span(
            "kv.receive",
            attributes={
                "pdmesh.kv.transfer_id": spec.transfer_id,
                "pdmesh.kv.transport": transport,
                "pdmesh.kv.blocks": spec.num_blocks,
                "pdmesh.kv.layers": geometry.num_layers,
            },
        )

    @staticmethod
    def transfer_ended(
        span: Span | None, stats: TransferStats | None, error: BaseException | None = None
    ) -> None:
        if span is None:
            return
        if stats is not None:
            span.set_attribute("pdmesh.kv.bytes", stats.bytes)
            span.set_attribute("pdmesh.kv.frames", stats.frames)
            span.set_attribute("pdmesh.kv.seconds", stats.seconds)
        tracing.end_span(span, error=error)
