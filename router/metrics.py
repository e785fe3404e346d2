"""The router's Prometheus metrics (default registry, names under `pdmesh_router_`).

Declared once here so every edge (the HTTP gateway, the gRPC API) records the same series; add a
metric by declaring it below and recording it through `RequestRecorder` or a function next to it.
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Latencies of an LLM request span milliseconds (a cached short prompt) to minutes (long outputs).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "pdmesh_router_requests",
    "Requests answered, by endpoint and status (HTTP status code, or gRPC status name).",
    ["endpoint", "status"],
)
PROMPT_TOKENS = Counter(
    "pdmesh_router_prompt_tokens", "Prompt tokens of admitted requests.", ["endpoint"]
)
GENERATED_TOKENS = Counter(
    "pdmesh_router_generated_tokens", "Tokens generated and sent to clients.", ["endpoint"]
)
REQUEST_LATENCY = Histogram(
    "pdmesh_router_request_latency_seconds",
    "Arrival at the router to the last token (or the error).",
    ["endpoint"],
    buckets=LATENCY_BUCKETS_S,
)
TTFT = Histogram(
    "pdmesh_router_time_to_first_token_seconds",
    "Arrival at the router to the first generated token.",
    ["endpoint"],
    buckets=TTFT_BUCKETS_S,
)

# Workers as this router sees them (router/registry.py): true under pdmesh up, Compose and
# Kubernetes alike, whoever restarts the workers.
WORKER_UP = Gauge(
    "pdmesh_router_worker_up",
    "1 while the worker is in rotation (its health check says SERVING), else 0.",
    ["role", "worker"],
)
WORKER_DOWN = Counter(
    "pdmesh_router_worker_down",
    "Times a worker left the rotation: its health check failed or stopped saying SERVING "
    "(a crash, a restart, a drain, a network cut).",
    ["role", "worker"],
)
WORKER_RESTARTS = Counter(
    "pdmesh_router_worker_restarts",
    "Times a worker came back as a new process (the start time in its stats changed).",
    ["role", "worker"],
)
WORKER_ROLE_SWITCHES = Counter(
    "pdmesh_router_worker_role_switches",
    "Times a worker changed role (`pdmesh role`, SetWorkerRole), by the role it took.",
    ["worker", "role"],
)
WORKER_STREAMS = Gauge(
    "pdmesh_router_worker_streams",
    "Requests this router has on the decode worker now (submitted and not yet ended).",
    ["worker"],
)
PREFILL_SECONDS_PER_TOKEN = Gauge(
    "pdmesh_router_prefill_seconds_per_token",
    "The prefill rate this router measures (a moving average, router/prefill_rate.py): remote "
    "(Submit to first token per token its prefill worker computed first, its queue included), "
    "local (per uncached token of a prompt its decode worker prefilled).",
    ["where"],
)
REQUESTS_FAILED_WORKER_LOST = Counter(
    "pdmesh_router_requests_failed_worker_lost",
    "Requests that ended in an error after a decode worker serving them was lost (those moved "
    "to another worker and finished are pdmesh_router_failovers{reason=worker_lost}).",
)


class RequestRecorder:
    """One request's measurements; call `prompt`, `tokens` per chunk, then `done` once."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self.first_token_s: float | None = None
        self.completion_tokens = 0
        self._done = False

    def prompt(self, num_tokens: int) -> None:
        PROMPT_TOKENS.labels(self.endpoint).inc(num_tokens)

    def tokens(self, num_tokens: int) -> None:
        if num_tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.start
            TTFT.labels(self.endpoint).observe(self.first_token_s)
        self.completion_tokens += num_tokens

    def done(self, status: str) -> None:
        if self._done:
            return
        self._done = True
        REQUESTS.labels(self.endpoint, status).inc()
        if self.completion_tokens:
            GENERATED_TOKENS.labels(self.endpoint).inc(self.completion_tokens)
        REQUEST_LATENCY.labels(self.endpoint).observe(time.perf_counter() - self.start)


def worker_health(role: str, address: str, up: bool) -> None:
    """A worker joined (`up`) or left the rotation."""
    WORKER_UP.labels(role, address).set(1 if up else 0)
    if not up:
        WORKER_DOWN.labels(role, address).inc()


def worker_role(address: str, old: str, new: str, up: bool) -> None:
    """A worker changed role: its up gauge moves to the new role's label (counters keep the
    old role's series)."""
    with contextlib.suppress(KeyError):  # not made yet
        WORKER_UP.remove(old, address)
    WORKER_UP.labels(new, address).set(1 if up else 0)
    WORKER_ROLE_SWITCHES.labels(address, new).inc()


def prefill_rate(remote: bool, seconds_per_token: float) -> None:
    PREFILL_SECONDS_PER_TOKEN.labels("remote" if remote else "local").set(seconds_per_token)


def worker_restarted(role: str, address: str) -> None:
    WORKER_RESTARTS.labels(role, address).inc()


def request_failed_worker_lost() -> None:
    REQUESTS_FAILED_WORKER_LOST.inc()


def count_request(endpoint: str, status: str) -> None:
    """A request that never reached generation (a bad body, an unknown route)."""
    REQUESTS.labels(endpoint, status).inc()


def exposition() -> tuple[bytes, str]:
    """The default registry in the Prometheus text format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def worker_streams(address: str, streams: int) -> None:
    WORKER_STREAMS.labels(address).set(streams)
