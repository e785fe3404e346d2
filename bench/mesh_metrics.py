"""A running mesh as a benchmark reads it: the router's gRPC address and each service's
Prometheus `/metrics` (workers' roles, the planner's switches, the router's dispatch decisions,
histogram totals)."""

from __future__ import annotations

import collections
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Mesh:
    target: str  # the router's gRPC address
    metrics: dict[str, str]  # worker name -> its /metrics URL

    def samples(self, service: str) -> Iterator[Sample]:
        """Every sample on a service's /metrics."""
        text = urllib.request.urlopen(self.metrics[service], timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            yield from family.samples

    def roles(self) -> dict[str, int]:
        """How many workers serve each role now (their pdmesh_worker_role gauges)."""
        workers = [w for w in self.metrics if w.startswith(("prefill", "decode"))]
        roles = [
            s.labels["role"]
            for w in workers
            for s in self.samples(w)
            if s.name == "pdmesh_worker_role" and s.value == 1
        ]
        return dict(collections.Counter(roles))

    def switches(self) -> dict[str, float]:
        """The planner's role switches so far, `to_role/reason` (failed ones `failed/to_role`),
        from the router's /metrics."""
        found = {}
        for s in self.samples("router"):
            if s.name == "pdmesh_router_planner_switches_total":
                found[f"{s.labels['to_role']}/{s.labels['reason']}"] = s.value
            elif s.name == "pdmesh_router_planner_switches_failed_total":
                found[f"failed/{s.labels['to_role']}"] = s.value
        return found

    def dispatches(self) -> dict[str, float]:
        """The router's dispatch decisions so far, by outcome (remote_prefill, local_prefill)."""
        return {
            s.labels["outcome"]: s.value
            for s in self.samples("router")
            if s.name == "pdmesh_router_dispatch_decisions_total"
        }

    def scrape(self, worker: str, name: str) -> tuple[float, float]:
        """(sum, count) of one histogram of a worker, summed over its label sets."""
        total = count = 0.0
        for s in self.samples(worker):
            if s.name == f"{name}_sum":
                total += s.value
            elif s.name == f"{name}_count":
                count += s.value
        return total, count
