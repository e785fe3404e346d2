"""A worker's `/metrics` endpoint: its own registry, served by a thread of prometheus_client.

Each worker owns a registry (not the global one), so two workers in one process (tests,
benchmarks) never collide; the process's CPU, memory and GC figures are added to it.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from pdmesh.logger import get_logger

log = get_logger(__name__)


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def split_host_port(bind: str, what: str = "metrics address") -> tuple[str, int]:
    """(host, port) of "HOST:PORT" (no host: all interfaces); ValueError naming `what`."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"the {what} must be HOST:PORT, got {bind!r}.")
    return host.strip("[]") or "0.0.0.0", int(port)


class MetricsServer:
    """Serves `registry` at http://bind/metrics until `stop()`."""

    def __init__(self, bind: str, registry: CollectorRegistry) -> None:
        host, port = split_host_port(bind)
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server: Any = server
        self._thread: threading.Thread = thread
        self.port: int = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
