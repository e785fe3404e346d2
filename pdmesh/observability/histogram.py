"""A Prometheus histogram cheap enough to observe once per generated token.

prometheus_client's Histogram takes a lock per value it updates, and the inter-token latency is
observed for every token of every running request, on the engine thread: here an observation is
a bisect and two additions. One thread writes; a scrape reads plain ints under the GIL, so it
may see a count before its sum, but never a malformed histogram: the count is derived from the
buckets it reads.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Latencies of LLM serving span a cached short prompt's milliseconds to a long answer's minutes.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                  10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FastHistogram:
    """One histogram (fixed label values) and a Prometheus collector of it."""

    __slots__ = ("_bounds", "_counts", "_labels", "_sum", "documentation", "name")

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labels: Mapping[str, str] | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be increasing and not empty, got {buckets!r}")
        self.name = name
        self.documentation = documentation
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._labels = dict(labels or {})

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (tokens that arrived together share their latency)."""
        self._counts[bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def observe_ns(self, ns: float, count: int = 1) -> None:
        """`observe` a duration given in ns; a wall clock that stepped back counts as 0 s."""
        self.observe(max(0.0, ns) * 1e-9, count)

    def _family(self, with_samples: bool) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self._labels))
        if with_samples:
            counts = list(self._counts)  # one read, so buckets and count agree
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip([*self._bounds, float("inf")], counts, strict=True):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(list(self._labels.values()), buckets, self._sum)
        return family

    def collect(self) -> Iterator[HistogramMetricFamily]:
        yield self._family(with_samples=True)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield self._family(with_samples=False)

    @property
    def count(self) -> int:
        return sum(self._counts)
