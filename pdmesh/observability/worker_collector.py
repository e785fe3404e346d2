"""A worker's engine and KV-transfer state, read when Prometheus scrapes (nothing per step).

The service hands over a `snapshot` function that reads its counters directly, without a round
trip through the engine thread: a scrape never waits behind a long forward, and a value may be
one step old. Every family is described even when it has no samples yet (a dense model has no
experts), so dashboards and checks see the same names on every worker of a role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdmesh.observability.histogram import TRANSFER_BUCKETS_S, FastHistogram
from pdmesh.observability.metrics_server import new_registry


@dataclass(frozen=True)
class TransferTotals:
    """KV-transfer counters since start, from one of the worker's senders or receivers."""

    direction: str  # "send" (prefill) or "receive" (decode)
    transport: str  # "tcp", "nccl", ...
    bytes: int
    seconds: float  # summed over transfers, first frame to last
    transfers: int
    failed: int
    frames_dropped: int = 0


@dataclass(frozen=True)
class WorkerSnapshot:
    engine: Mapping[str, int]  # EngineStats under the WorkerStats message's names
    transfers: Sequence[TransferTotals]  # one per transport in use
    expert_token_counts: Sequence[int] = ()
    prefills: Mapping[str, int] = field(default_factory=dict)  # by mode: local, remote, fallback
    eplb: EplbFigures | None = None  # None: EPLB off
    store: Mapping[str, float] | None = None  # StoreLink.figures(); None: no KV store
    role: str | None = None  # the role now, for a worker that changes role; None: its one


@dataclass(frozen=True)
class EplbFigures:
    """EPLB's figures over every rank as of its last rebalance (see ExpertBalancer.published)."""

    physical_expert_tokens: Sequence[int]  # [P] per physical slot, summed over MoE layers
    rebalances: int
    imbalance: float  # max / mean tokens per rank under the placement last replaced


class WorkerCollector:
    def __init__(self, role: str, snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.role = role
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._snapshot())

    def _families(self, s: WorkerSnapshot | None) -> Iterator[Metric]:
        role = (s.role if s is not None else None) or self.role
        now = GaugeMetricFamily(
            "pdmesh_worker_role", "1 for the role the worker serves now.", labels=["role"]
        )
        if s is not None:
            now.add_metric([role], 1)
        yield now
        values = _engine_values(s.engine) if s is not None else {}
        for key, (kind, name, doc) in _ENGINE_FAMILIES.items():
            family = kind(name, doc, labels=["role"])
            if s is not None:
                family.add_metric([role], values[key])
            yield family
        yield from _transfer_families(s.transfers if s else ())
        experts = CounterMetricFamily(
            "pdmesh_expert_tokens", "Tokens routed to each MoE expert.", labels=["role", "expert"]
        )
        prefills = CounterMetricFamily(
            "pdmesh_prefills", "Prompts prefilled, by where.", labels=["role", "mode"]
        )
        if s is not None:
            for expert, n in enumerate(s.expert_token_counts):
                experts.add_metric([role, str(expert)], n)
            for mode, n in s.prefills.items():
                prefills.add_metric([role, mode], n)
        yield experts
        yield prefills
        yield from _eplb_families(role, s.eplb if s is not None else None)
        for key, (kind, name, doc) in _STORE_FAMILIES.items():
            family = kind(name, doc, labels=["role"])
            if s is not None and s.store is not None:
                family.add_metric([role], s.store[key])
            yield family


def _eplb_families(role: str, e: EplbFigures | None) -> Iterator[Metric]:
    slots = CounterMetricFamily(
        "pdmesh_eplb_physical_expert_tokens",
        "EPLB: tokens sent to each physical expert slot, summed over MoE layers (as of the last "
        "rebalance).",
        labels=["role", "physical_expert"],
    )
    rebalances = CounterMetricFamily(
        "pdmesh_eplb_rebalances", "EPLB: expert placements recomputed and applied.", labels=["role"]
    )
    imbalance = GaugeMetricFamily(
        "pdmesh_eplb_imbalance",
        "EPLB: max / mean tokens per expert-parallel rank under the placement the last rebalance "
        "replaced (1 = balanced).",
        labels=["role"],
    )
    if e is not None:
        for slot, n in enumerate(e.physical_expert_tokens):
            slots.add_metric([role, str(slot)], n)
        rebalances.add_metric([role], e.rebalances)
        imbalance.add_metric([role], e.imbalance)
    yield from (slots, rebalances, imbalance)


def _engine_values(e: Mapping[str, int]) -> dict[str, float]:
    return {**e, "prefix_hit_rate": e["prefix_hit_tokens"] / max(1, e["prefix_queried_tokens"])}


G, C = GaugeMetricFamily, CounterMetricFamily
# WorkerSnapshot.engine key -> (family, metric name, help), labelled by role.
_ENGINE_FAMILIES: dict[str, tuple[type[Metric], str, str]] = {
    "num_running": (G, "pdmesh_requests_running", "Requests in the running batch."),
    "num_waiting": (G, "pdmesh_requests_waiting", "Requests queued for admission."),
    "kv_blocks_total": (G, "pdmesh_kv_blocks_total", "KV-cache blocks."),
    "kv_blocks_used": (G, "pdmesh_kv_blocks_used", "KV-cache blocks in use."),
    "kv_blocks_free": (G, "pdmesh_kv_blocks_free", "KV-cache blocks free."),
    "prefix_queried_tokens": (
        C,
        "pdmesh_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_hit_tokens": (
        C,
        "pdmesh_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache.",
    ),
    "prefix_hit_rate": (
        G,
        "pdmesh_prefix_cache_hit_rate",
        "Hit tokens / queried tokens since start (rate() the counters for a window).",
    ),
    "num_preemptions": (C, "pdmesh_preemptions", "Requests preempted (recomputed later)."),
    "steps_launched_ahead": (
        C,
        "pdmesh_steps_launched_ahead",
        "Decode steps launched before the previous step's tokens were read (async "
        "scheduling: the host's work hidden behind the device's).",
    ),
    "host_tier_blocks_total": (G, "pdmesh_host_kv_blocks_total", "Host KV tier: block slots."),
    "host_tier_blocks_used": (G, "pdmesh_host_kv_blocks_used", "Host KV tier: slots in use."),
    "host_tier_hit_blocks": (
        C,
        "pdmesh_host_kv_hit_blocks",
        "Prompt blocks loaded from the host KV tier instead of recomputed.",
    ),
    "host_tier_hit_tokens": (
        C,
        "pdmesh_host_kv_hit_tokens",
        "Prompt tokens loaded from the host KV tier instead of recomputed.",
    ),
    "host_tier_offloaded_bytes": (
        C,
        "pdmesh_host_kv_offloaded_bytes",
        "KV bytes copied to the host tier as blocks left the device cache.",
    ),
    "host_tier_loaded_bytes": (
        C,
        "pdmesh_host_kv_loaded_bytes",
        "KV bytes copied back from the host tier.",
    ),
    "host_tier_copy_seconds": (
        C,
        "pdmesh_host_kv_copy_seconds",
        "Seconds rank 0 spent copying KV to and from the host tier.",
    ),
    "spec_draft_tokens": (
        C,
        "pdmesh_spec_draft_tokens",
        "Speculative decoding: draft tokens verified by the target model.",
    ),
    "spec_accepted_tokens": (
        C,
        "pdmesh_spec_accepted_tokens",
        "Speculative decoding: draft tokens accepted (output).",
    ),
}


# StoreLink.figures() key -> (family, metric name, help), labelled by role (--kvstore).
_STORE_FAMILIES: dict[str, tuple[type[Metric], str, str]] = {
    "store_lookups": (C, "pdmesh_store_lookups", "KV store: prompts looked up before computing."),
    "store_lookup_blocks": (
        C,
        "pdmesh_store_lookup_blocks",
        "KV store: full prompt blocks looked up (the hit rate's denominator).",
    ),
    "store_hit_blocks": (
        C,
        "pdmesh_store_hit_blocks",
        "KV store: prompt blocks fetched from the store instead of computed.",
    ),
    "store_hit_tokens": (C, "pdmesh_store_hit_tokens", "KV store: prompt tokens fetched."),
    "store_fetch_failures": (
        C,
        "pdmesh_store_fetch_failures",
        "KV store: fetches that failed, stalled or named other tokens (computed instead).",
    ),
    "store_fetched_bytes": (C, "pdmesh_store_fetched_bytes", "KV store: bytes fetched."),
    "store_fetch_seconds": (C, "pdmesh_store_fetch_seconds", "KV store: seconds fetching."),
    "store_published_blocks": (
        C,
        "pdmesh_store_published_blocks",
        "KV store: computed blocks pushed to the store (write-behind).",
    ),
    "store_published_bytes": (C, "pdmesh_store_published_bytes", "KV store: bytes pushed."),
    "store_publish_seconds": (C, "pdmesh_store_publish_seconds", "KV store: seconds pushing."),
    "store_hit_rate": (
        G,
        "pdmesh_store_hit_rate",
        "KV store: blocks fetched / blocks looked up since start.",
    ),
}


def _transfer_families(totals: Sequence[TransferTotals]) -> Iterator[Metric]:
    for attr, (name, doc) in _TRANSFER_FAMILIES.items():
        family = CounterMetricFamily(name, doc, labels=["direction", "transport"])
        for t in totals:
            family.add_metric([t.direction, t.transport], getattr(t, attr))
        yield family


# TransferTotals field -> (metric name, help), labelled by direction and transport.
_TRANSFER_FAMILIES = {
    "bytes": ("pdmesh_kv_transfer_bytes", "KV-transfer payload bytes."),
    "seconds": (
        "pdmesh_kv_transfer_seconds",
        "Seconds KV transfers took, first frame to last (bytes / seconds: bandwidth).",
    ),
    "transfers": ("pdmesh_kv_transfers", "KV transfers completed."),
    "failed": ("pdmesh_kv_transfer_failures", "KV transfers that failed."),
    "frames_dropped": (
        "pdmesh_kv_transfer_frames_dropped",
        "KV frames refused by the receiver (unknown transfer, bad token or size).",
    ),
}


def transfer_histogram(direction: str) -> FastHistogram:
    """One KV transfer's duration, as a worker of `direction` ("send", "receive") sees it."""
    return FastHistogram(
        "pdmesh_kv_transfer_duration_seconds",
        "One KV transfer, first frame to last.",
        TRANSFER_BUCKETS_S,
        {"direction": direction},
    )


def worker_registry(
    role: str, snapshot: Callable[[], WorkerSnapshot], *collectors: Collector
) -> CollectorRegistry:
    """A worker's /metrics: its own `collectors`, then the engine and KV state of `snapshot`."""
    registry = new_registry()
    for collector in (*collectors, WorkerCollector(role, snapshot)):
        registry.register(collector)
    return registry
