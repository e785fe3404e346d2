"""Live migration's figures on one decode worker, both directions: requests handed over (out)
and continued here (in) by result, the KV bytes moved, and how long each hand-over took.

Prometheus (registered in the worker's /metrics):
    pdmesh_migrations_total{direction, result}     out: migrated | recomputed | expired;
                                                   in: migrated | recomputed
    pdmesh_migration_bytes_total{direction}        KV payload bytes pushed (out) / received (in)
    pdmesh_migration_duration_seconds{direction}   out: Migrate call served; in: Submit to commit

Written on the event loop, read by the scrape thread (plain ints and lists: a read may be one
observation behind, never torn).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pdmesh.observability.histogram import TRANSFER_BUCKETS_S

DIRECTIONS = ("out", "in")


class MigrationMetrics:
    def __init__(self) -> None:
        self.results: dict[tuple[str, str], int] = {}  # (direction, result) -> requests
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self._bounds = [float(b) for b in TRANSFER_BUCKETS_S]
        self._counts = {d: [0] * (len(self._bounds) + 1) for d in DIRECTIONS}
        self._sums = dict.fromkeys(DIRECTIONS, 0.0)

    def count(self, direction: str, result: str, nbytes: int = 0, seconds: float = -1) -> None:
        """One request's hand-over ended with `result`; its KV bytes and duration when it moved
        any."""
        key = (direction, result)
        self.results[key] = self.results.get(key, 0) + 1
        self.bytes[direction] += nbytes
        if seconds >= 0:
            self._counts[direction][bisect_left(self._bounds, seconds)] += 1
            self._sums[direction] += seconds

    def n(self, direction: str, result: str) -> int:
        return self.results.get((direction, result), 0)

    def stats_fields(self) -> dict[str, Any]:
        """The WorkerStats fields of migration."""
        return {
            "migrations_out": self.n("out", "migrated"),
            "migrations_in": self.n("in", "migrated"),
            "migration_fallbacks": self.n("out", "recomputed")
            + self.n("out", "expired")
            + self.n("in", "recomputed"),
            "migration_bytes_sent": self.bytes["out"],
            "migration_bytes_received": self.bytes["in"],
        }

    # -- the Prometheus collector -----------------------------------------------------------------
    def describe(self) -> Iterator[Metric]:
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        moved = CounterMetricFamily(
            "pdmesh_migrations",
            "Running requests handed over to (out) or continued from (in) another decode worker.",
            labels=["direction", "result"],
        )
        nbytes = CounterMetricFamily(
            "pdmesh_migration_bytes", "KV bytes moved by live migration.", labels=["direction"]
        )
        seconds = HistogramMetricFamily(
            "pdmesh_migration_duration_seconds",
            "One request's hand-over: its KV push (out), or Submit to its commit (in).",
            labels=["direction"],
        )
        if with_samples:
            for (direction, result), n in list(self.results.items()):
                moved.add_metric([direction, result], n)
            for direction in DIRECTIONS:
                nbytes.add_metric([direction], self.bytes[direction])
                cumulative, buckets = 0, []
                counts = list(self._counts[direction])
                for bound, n in zip([*self._bounds, float("inf")], counts, strict=True):
                    cumulative += n
                    buckets.append((floatToGoString(bound), cumulative))
                seconds.add_metric([direction], buckets, self._sums[direction])
        yield moved
        yield nbytes
        yield seconds
