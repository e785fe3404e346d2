"""Building a pdmesh gRPC server (health, reflection, message-size limits, error mapping, TLS) and
the channels between services."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pdmesh.observability import tracing
from pdmesh.serving.errors import ErrorInterceptor
from pdmesh.serving.tls import TLSConfig

# Deliberate limits: the largest legitimate message is a long prompt's token ids (a few MB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Both ends: message limits, and keepalive pings every 20 s even on idle connections.
_COMMON_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]

SERVER_OPTIONS = [
    *_COMMON_OPTIONS,
    # Accept the clients' keepalive pings (every 20 s, CHANNEL_OPTIONS) on idle connections. By
    # default a server wants 5 minutes between pings without data and answers the third early
    # one with GOAWAY "too_many_pings", failing the calls then in flight on that connection.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

CHANNEL_OPTIONS = [
    *_COMMON_OPTIONS,
    ("grpc.enable_retries", 0),
    # A started or restarted worker must be found again within a second: gRPC's default
    # reconnect back-off grows to two minutes while it is down (with 3 s here, a mesh's workers
    # joined 2.7 s after they were serving; a connect attempt a second to a dead one is nothing).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class ServiceSpec:
    name: str  # the full service name, e.g. "pdmesh.v1.DecodeWorker"
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


class Health:
    """The standard grpc.health.v1 service; '' is the whole server."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health_aio.HealthServicer()
        self._names = ["", *service_names]

    async def set(self, serving: bool) -> None:
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if serving else response.NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)


def build_server(
    bind: str,
    services: Sequence[ServiceSpec],
    interceptors: Sequence[Any] = (),
    tls: TLSConfig | None = None,
    require_client_cert: bool = True,
) -> tuple[grpc.aio.Server, Health, int]:
    """A server on `bind` (host:port; port 0 picks one) with health and reflection on; TLS when
    `tls` is given (mutual when it names a CA and `require_client_cert`). Interceptors run
    after tracing and before the error mapping. Returns (server, health, bound port); call
    `await server.start()`."""
    # Tracing (when on) is outermost, so its span sees the status the error interceptor sets.
    server = grpc.aio.server(
        interceptors=[*tracing.server_interceptors(), *interceptors, ErrorInterceptor()],
        options=SERVER_OPTIONS,
    )
    names = [s.name for s in services]
    for spec in services:
        spec.add_to_server(spec.servicer, server)
    health = Health(names)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*names, health_name, reflection.SERVICE_NAME], server)
    if tls is not None:
        port = server.add_secure_port(bind, tls.server_credentials(require_client_cert))
    else:
        port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot bind {bind}")
    return server, health, port


def channel(target: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A channel to another pdmesh service (over TLS when `tls` is given, presenting its
    certificate); it carries the trace context when tracing is on."""
    interceptors = tracing.client_interceptors() or None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        target,
        tls.channel_credentials(),
        options=[*CHANNEL_OPTIONS, *tls.channel_options()],
        interceptors=interceptors,
    )


def blocking_channel(target: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """A synchronous channel, for command-line tools (health checks, `pdmesh up`)."""
    if tls is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(
        target, tls.channel_credentials(), options=[*CHANNEL_OPTIONS, *tls.channel_options()]
    )
