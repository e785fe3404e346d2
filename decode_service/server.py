"""`pdmesh decode`: one decode worker process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdmesh.decode_service.config import DecodeConfig
from pdmesh.decode_service.kv_receivers import RANK_EXTENSION, extension_options
from pdmesh.decode_service.servicer import DecodeServicer
from pdmesh.decode_service.worker import DecodeWorker
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.observability.metrics_server import MetricsServer
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.v1 import worker_pb2_grpc

log = get_logger(__name__)
SERVICE = "pdmesh.v1.DecodeWorker"


async def serve(config: DecodeConfig, on_ready: Callable[[int], None] | None = None) -> None:
    tracing.setup("pdmesh-decode")
    engine = await asyncio.to_thread(
        LLMEngine, config.engine, RANK_EXTENSION, extension_options(config)
    )
    worker = DecodeWorker(config, engine)
    worker.start(asyncio.get_running_loop())
    metrics = (
        MetricsServer(config.metrics_bind, worker.metrics.registry) if config.metrics_bind else None
    )
    server, health, port = build_server(
        config.bind,
        [
            ServiceSpec(
                SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, DecodeServicer(worker)
            )
        ],
        tls=config.tls,
    )
    await server.start()
    planes = ", ".join(f"{name} at {a}" for name, a in worker.kv.addresses.items())
    log.info("decode worker on port %d, KV data plane: %s", port, planes)
    if on_ready is not None:
        on_ready(port)

    async def stop() -> None:
        await worker.close()
        if metrics is not None:
            metrics.stop()
        tracing.shutdown()

    await serve_until_stopped(server, health, stop, worker.stopped)
