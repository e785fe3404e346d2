"""`pdmesh prefill`: one prefill worker process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.observability.metrics_server import MetricsServer
from pdmesh.prefill_service.config import PrefillConfig
from pdmesh.prefill_service.servicer import PrefillServicer
from pdmesh.prefill_service.worker import PrefillWorker
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.v1 import worker_pb2_grpc

log = get_logger(__name__)
SERVICE = "pdmesh.v1.PrefillWorker"


async def serve(config: PrefillConfig, on_ready: Callable[[int], None] | None = None) -> None:
    tracing.setup("pdmesh-prefill")
    engine = await asyncio.to_thread(LLMEngine, config.engine, PrefillWorker.RANK_EXTENSION, {})
    worker = PrefillWorker(config, engine)
    worker.start(asyncio.get_running_loop())
    metrics = (
        MetricsServer(config.metrics_bind, worker.metrics.registry) if config.metrics_bind else None
    )
    server, health, port = build_server(
        config.bind,
        [
            ServiceSpec(
                SERVICE,
                worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
                PrefillServicer(worker),
            )
        ],
        tls=config.tls,
    )
    await server.start()
    log.info("prefill worker on port %d", port)
    if on_ready is not None:
        on_ready(port)

    async def stop() -> None:
        await worker.close()
        if metrics is not None:
            metrics.stop()
        tracing.shutdown()

    await serve_until_stopped(server, health, stop, worker.stopped)
