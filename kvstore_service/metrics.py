"""The KV store's Prometheus metrics, `pdmesh_kvstore_*`: counters and state read from the store
at scrape time (one source with GetStats), and transfer-time histograms observed as transfers end.

The store hit rate is rate(pdmesh_kvstore_lookup_blocks_total{result="hit"}) over the sum of both
results; `pdmesh_kvstore_hit_ratio` gives the same since start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdmesh.kvstore_service.store import StoreStats
from pdmesh.observability.histogram import TRANSFER_BUCKETS_S
from pdmesh.observability.metrics_server import new_registry

IN, OUT = "in", "out"  # Puts bring blocks in, Gets send them out


class KVStoreMetrics:
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self.registry: CollectorRegistry = new_registry()
        # Observed from receiver threads (Puts) and the event loop (Gets): prometheus_client's
        # Histogram is thread-safe, and a transfer is observed once, not per frame.
        self.transfer_seconds = Histogram(
            "pdmesh_kvstore_transfer_seconds",
            "A block transfer of the KV store, first frame to last acknowledged; in: a Put's "
            "blocks arriving, out: a Get's blocks pushed.",
            ["direction"],
            buckets=TRANSFER_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(stats))

    def transferred(self, direction: str, seconds: float) -> None:
        self.transfer_seconds.labels(direction).observe(seconds)


class _StoreCollector:
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._stats())

    def _families(self, s: StoreStats | None) -> Iterator[Metric]:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(f"pdmesh_kvstore_{name}", doc, labels=list(labels))

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pdmesh_kvstore_{name}", doc, labels=list(labels))

        lookups = counter("lookups", "Lookup calls answered.")
        blocks = counter(
            "lookup_blocks", "Full blocks asked about by lookups: held (hit) or not.", ("result",)
        )
        mismatches = counter(
            "token_mismatches", "Held keys whose tokens differed from the asker's (misses)."
        )
        transfers = counter(
            "transfers",
            "Block transfers that ended, by direction and result.",
            ("direction", "result"),
        )
        moved = counter("blocks_moved", "Blocks stored (in) and served (out).", ("direction",))
        nbytes = counter("bytes", "Payload bytes received (in) and sent (out).", ("direction",))
        evictions = counter("evictions", "Blocks evicted, least recently used, to make room.")
        held = gauge(
            "blocks",
            "Slots of the pool by state: held (a block; pinned ones too), pinned (read by a Get), "
            "filling (reserved by a Put in flight).",
            ("state",),
        )
        held_bytes = gauge("bytes_held", "Payload bytes of the blocks held.")
        capacity = gauge("capacity_bytes", "The byte budget of block payloads.")
        ratio = gauge("hit_ratio", "Hit blocks over blocks asked about, since start.")
        if s is not None:
            lookups.add_metric([], s.lookups)
            blocks.add_metric(["hit"], s.hit_blocks)
            blocks.add_metric(["miss"], s.lookup_blocks - s.hit_blocks)
            mismatches.add_metric([], s.token_mismatches)
            transfers.add_metric([IN, "ok"], s.puts)
            transfers.add_metric([IN, "failed"], s.puts_failed)
            transfers.add_metric([OUT, "ok"], s.gets)
            transfers.add_metric([OUT, "failed"], s.gets_failed)
            moved.add_metric([IN], s.blocks_stored)
            moved.add_metric([OUT], s.blocks_served)
            nbytes.add_metric([IN], s.bytes_in)
            nbytes.add_metric([OUT], s.bytes_out)
            evictions.add_metric([], s.evictions)
            held.add_metric(["held"], s.blocks_held)
            held.add_metric(["pinned"], s.blocks_pinned)
            held.add_metric(["filling"], s.blocks_filling)
            held_bytes.add_metric([], s.bytes_held)
            capacity.add_metric([], s.capacity_bytes)
            ratio.add_metric([], s.hit_rate)
        yield from (lookups, blocks, mismatches, transfers, moved, nbytes, evictions)
        yield from (held, held_bytes, capacity, ratio)
