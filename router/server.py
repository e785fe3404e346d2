"""`pdmesh router`: the router process (gRPC API, and the HTTP gateway when configured)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdmesh.checkpoint.config import ModelConfig
from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.processes import freeze_heap
from pdmesh.router.config import RouterConfig
from pdmesh.router.core import Router
from pdmesh.router.servicer import GenerationServicer, MeshControlServicer
from pdmesh.serving.auth import ApiKeyInterceptor
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.v1 import generation_pb2_grpc, worker_pb2_grpc

log = get_logger(__name__)
SERVICE = "pdmesh.v1.Generation"
CONTROL_SERVICE = "pdmesh.v1.MeshControl"


async def serve(config: RouterConfig, on_ready: Callable[[int], None] | None = None) -> None:
    tracing.setup("pdmesh-router")  # before any channel is made: they carry the trace context
    folder = await asyncio.to_thread(resolve_model_folder, config.model)
    info = await asyncio.to_thread(ModelConfig.load, folder)
    router = Router(config, info, await asyncio.to_thread(Tokenizer.load, folder))
    router.start()
    server, health, port = build_server(
        config.bind,
        [
            ServiceSpec(
                SERVICE,
                generation_pb2_grpc.add_GenerationServicer_to_server,
                GenerationServicer(router),
            ),
            ServiceSpec(
                CONTROL_SERVICE,
                worker_pb2_grpc.add_MeshControlServicer_to_server,
                MeshControlServicer(router),
            ),
        ],
        interceptors=[ApiKeyInterceptor(config.api_keys)] if config.api_keys.required else [],
        tls=config.tls,
        require_client_cert=config.public_client_auth,
    )
    await server.start()
    gateway = None
    if config.http_bind:
        from pdmesh.router.http_gateway import start_gateway

        gateway = await start_gateway(router)
    freeze_heap()
    log.info(
        "router on port %d (%s); workers: prefill %s, decode %s",
        port,
        router.model_name,
        list(config.prefill),
        list(config.decode),
    )
    if on_ready is not None:
        on_ready(port)

    async def stop() -> None:
        if gateway is not None:
            await gateway.cleanup()
        await router.close()
        tracing.shutdown()

    await serve_until_stopped(server, health, stop)
