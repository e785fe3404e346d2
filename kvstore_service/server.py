"""`pdmesh kvstore`: the KV store process (gRPC control plane with health and reflection, the
tcp data plane, `/metrics`, traces)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable

from pdmesh.kvstore_service.config import KVStoreConfig
from pdmesh.kvstore_service.metrics import KVStoreMetrics
from pdmesh.kvstore_service.servicer import KVStoreServicer
from pdmesh.kvstore_service.store import KVStore
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.observability.metrics_server import MetricsServer
from pdmesh.serving.auth import ApiKeyInterceptor
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.v1 import kvstore_pb2_grpc

log = get_logger(__name__)
SERVICE = "pdmesh.v1.KVStore"


def claim_data_port(config: KVStoreConfig) -> KVStoreConfig:
    """The config with its data plane's port fixed now: port 0 becomes a free port, and a port
    that cannot be bound is a ValueError at start, not at the first Put (which binds it, once
    the geometry is known)."""
    host, _, port = config.data_bind.removeprefix("tcp://").rpartition(":")
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        with socket.create_server(
            ("" if bare in ("*", "0.0.0.0") else bare, int(port)), family=family
        ) as s:
            chosen = s.getsockname()[1]
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot bind the KV store's data plane to {config.data_bind}: {e}."
        ) from None
    return dataclasses.replace(config, data_bind=f"tcp://{host}:{chosen}")


async def serve(config: KVStoreConfig, on_ready: Callable[[int], None] | None = None) -> None:
    tracing.setup("pdmesh-kvstore")
    config = claim_data_port(config)
    store = KVStore(config)
    metrics = KVStoreMetrics(store.stats)
    exporter = MetricsServer(config.metrics_bind, metrics.registry) if config.metrics_bind else None
    keys = [ApiKeyInterceptor(config.api_keys)] if config.api_keys.required else []
    servicer = KVStoreServicer(store, metrics)
    spec = ServiceSpec(SERVICE, kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer)
    server, health, port = build_server(config.bind, [spec], interceptors=keys, tls=config.tls)
    await server.start()
    log.info(
        "KV store on port %d: %.2f GiB for blocks, data plane %s (its geometry: the first Put's)",
        port,
        config.capacity_bytes / (1 << 30),
        config.data_advertise or config.data_bind,
    )
    if on_ready is not None:
        on_ready(port)

    async def stop() -> None:
        store.close()
        if exporter is not None:
            exporter.stop()
        tracing.shutdown()

    await serve_until_stopped(server, health, stop)
