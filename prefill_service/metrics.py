"""The prefill worker's Prometheus metrics: how long Prefill calls wait and run, how long their
KV pushes take, and the engine and KV-sender state read at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.observability.histogram import TTFT_BUCKETS_S, FastHistogram
from pdmesh.observability.worker_collector import (
    WorkerSnapshot,
    transfer_histogram,
    worker_registry,
)


class PrefillMetrics:
    def __init__(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        # Both over the TTFT buckets: a Prefill call ends with the request's first token.
        self.prefill, self.queue = (
            FastHistogram(name, doc, TTFT_BUCKETS_S)
            for name, doc in (
                (
                    "pdmesh_prefill_time_seconds",
                    "A Prefill call, received to first token (queueing and forward).",
                ),
                (
                    "pdmesh_prefill_queue_time_seconds",
                    "A Prefill call, received to its first forward step.",
                ),
            )
        )
        self.transfer = transfer_histogram("send")
        self.registry = worker_registry(
            "prefill", snapshot, self.prefill, self.queue, self.transfer
        )

    def prefilled(self, prefill_ns: int, queue_ns: int, transfer_s: float) -> None:
        self.prefill.observe_ns(prefill_ns)
        self.queue.observe_ns(queue_ns)
        self.transfer.observe(transfer_s)
