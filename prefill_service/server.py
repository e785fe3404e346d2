"""`pdmesh prefill`: one prefill worker process."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.kv_transfer.push_connector import PushConnector
from pdmesh.prefill_service.config import PrefillConfig
from pdmesh.prefill_service.servicer import PrefillServicer
from pdmesh.prefill_service.worker import PrefillWorker
from pdmesh.serving.grpc_server import ServiceSpec
from pdmesh.serving.worker_process import serve_worker
from pdmesh.v1 import worker_pb2_grpc

SERVICE = "pdmesh.v1.PrefillWorker"


async def serve(config: PrefillConfig, on_ready: Callable[[int], None] | None = None) -> None:
    connector = PushConnector()
    await serve_worker(
        "prefill",
        config,
        connector,
        lambda engine: PrefillWorker(config, connector, engine),
        lambda worker: [
            ServiceSpec(
                SERVICE,
                worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
                PrefillServicer(worker),
            )
        ],
        on_ready,
    )
