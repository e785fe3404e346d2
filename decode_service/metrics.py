"""The decode worker's Prometheus metrics: request latencies measured where the tokens are made,
and the engine and KV-receiver state read at scrape time.

The engine thread records into plain counters and `FastHistogram`s (a few additions per token);
the scrape thread formats them. Latencies start at the router's arrival time (carried in the
DecodeRequest), so TTFT includes queueing, a remote prefill and the KV transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, Metric

from pdmesh.observability.histogram import (
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    TTFT_BUCKETS_S,
    FastHistogram,
)
from pdmesh.observability.worker_collector import (
    WorkerSnapshot,
    transfer_histogram,
    worker_registry,
)


class DecodeMetrics:
    def __init__(self, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.ttft = FastHistogram(
            "pdmesh_time_to_first_token_seconds",
            "Arrival at the router to the request's first token.",
            TTFT_BUCKETS_S,
        )
        self.itl = FastHistogram(
            "pdmesh_inter_token_latency_seconds",
            "Time between two consecutive tokens of a request.",
            ITL_BUCKETS_S,
        )
        self.e2e = FastHistogram(
            "pdmesh_e2e_request_latency_seconds",
            "Arrival at the router to the request's last token.",
            E2E_BUCKETS_S,
        )
        self.queue = FastHistogram(
            "pdmesh_request_queue_time_seconds",
            "Arrival at the router to admission by the decode worker's engine.",
            TTFT_BUCKETS_S,
        )
        self.transfer = transfer_histogram("receive")
        self.generated_tokens = 0
        self.finished: dict[str, int] = {}  # by finish reason
        histograms = (self.ttft, self.itl, self.e2e, self.queue, self.transfer)
        self.registry = worker_registry("decode", snapshot, *histograms, _Counters(self))

    # -- engine thread ----------------------------------------------------------------------------
    def first_token(self, ttft_ns: int, n: int) -> None:
        """A request's first `n` tokens, `ttft_ns` after it reached the router."""
        self.generated_tokens += n
        self.ttft.observe_ns(ttft_ns)

    def next_tokens(self, gap_ns: int, n: int) -> None:
        """`n` more tokens of a request, `gap_ns` after its previous ones (they share the gap)."""
        self.generated_tokens += n
        self.itl.observe_ns(gap_ns / n, n)

    def finish(self, reason: str, queue_ns: int, total_ns: int) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.queue.observe_ns(queue_ns)
        self.e2e.observe_ns(total_ns)


class _Counters:
    def __init__(self, metrics: DecodeMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterator[Metric]:
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "pdmesh_generation_tokens", "Tokens generated.", labels=["role"]
        )
        finished = CounterMetricFamily(
            "pdmesh_requests_finished", "Requests finished, by reason.", labels=["finish_reason"]
        )
        if with_samples:
            tokens.add_metric(["decode"], self._m.generated_tokens)
            for reason, n in list(self._m.finished.items()):
                finished.add_metric([reason], n)
        yield tokens
        yield finished
