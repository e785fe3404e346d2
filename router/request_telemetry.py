"""Observability hooks of one router request: the dispatch-decision metric, and its spans when
tracing is on (pdmesh.observability.tracing):

    router.request     the request on the router, dispatch to last chunk relayed (child of the
                       Generate call's span; a root for HTTP requests)
      router.dispatch    waiting for a ready decode worker and the policy's choice: the chosen
                         workers and why (the policy's Decision.reason)
      (the Submit call to the decode worker, by the gRPC instrumentation)

Nothing here runs per token: `Router.generate` calls it when a request starts, is dispatched and
ends.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager

from opentelemetry.trace import Span
from prometheus_client import Counter

from pdmesh.observability import tracing
from pdmesh.router.policies import Decision
from pdmesh.sampling_params import SamplingParams

# Default registry, beside the gateway's metrics (router/metrics.py), served at its /metrics.
DISPATCH_DECISIONS = Counter(
    "pdmesh_router_dispatch_decisions",
    "Dispatch decisions, by policy and outcome: remote_prefill (a prefill worker fills the decode "
    "worker's blocks), local_prefill (the decode worker prefills), no_decode_worker (refused).",
    ["policy", "outcome"],
)
FAILOVERS = Counter(
    "pdmesh_router_failovers",
    "Requests moved to another decode worker, by reason: worker_lost (its stream broke "
    "mid-request), submit_failed (unreachable), queue_full (it refused with RESOURCE_EXHAUSTED).",
    ["reason"],
)


class RequestTelemetry:
    __slots__ = ("_start_ns", "policy", "span")

    def __init__(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams, policy: str
    ):
        self.policy = policy
        self.span: Span | None = None
        self._start_ns = 0
        if tracing.enabled():
            self._start_ns = time.time_ns()
            self.span = tracing.start_span(
                "router.request",
                start_ns=self._start_ns,
                attributes={
                    "pdmesh.request_id": request_id,
                    "pdmesh.prompt_tokens": num_prompt_tokens,
                    "pdmesh.max_tokens": params.max_tokens,
                },
            )

    def no_worker(self) -> None:
        DISPATCH_DECISIONS.labels(self.policy, "no_decode_worker").inc()
        if self.span is not None:
            self._dispatch_span("no_decode_worker", {}, "no decode worker is available")
            tracing.end_span(self.span, error="no decode worker is available")

    def dispatched(self, decision: Decision) -> None:
        outcome = "remote_prefill" if decision.prefill is not None else "local_prefill"
        DISPATCH_DECISIONS.labels(self.policy, outcome).inc()
        if self.span is None:
            return
        workers = {
            "pdmesh.decode_worker": decision.decode.address,
            "pdmesh.prefill_worker": decision.prefill.address if decision.prefill else "",
        }
        self.span.set_attributes(workers)
        self._dispatch_span(
            outcome,
            {
                **workers,
                "pdmesh.dispatch.reason": decision.reason,
                "pdmesh.dispatch.prefill_miss_blocks": decision.prefill_miss_blocks,
            },
        )

    def failover(self, reason: str) -> None:
        FAILOVERS.labels(reason).inc()
        if self.span is not None:
            self.span.add_event("pdmesh.failover", {"pdmesh.failover.reason": reason})

    def _dispatch_span(self, outcome: str, attributes: dict[str, object], error: str = "") -> None:
        assert self.span is not None
        tracing.record_span(
            "router.dispatch",
            self._start_ns,
            time.time_ns(),
            tracing.context_of(self.span),
            {"pdmesh.policy": self.policy, "pdmesh.dispatch.outcome": outcome, **attributes},
            error or None,
        )

    def active(self) -> AbstractContextManager[None]:
        """Calls made inside (the Submit) become children of the request's span."""
        return tracing.use(self.span)

    def end(self, finished: bool) -> None:
        """From the request's `finally`: an unfinished request ends with the exception that is
        propagating (GeneratorExit: the client went away)."""
        if self.span is None:
            return
        error: BaseException | str | None = None
        if not finished:
            exc = sys.exc_info()[1]
            error = "the client went away" if exc is None or isinstance(exc, GeneratorExit) else exc
        tracing.end_span(self.span, error=error)
