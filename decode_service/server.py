"""`pdmesh decode`: one decode worker process."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.decode_service.config import DecodeConfig
from pdmesh.decode_service.servicer import DecodeServicer
from pdmesh.decode_service.worker import DecodeWorker
from pdmesh.kv_transfer.receive_connector import ReceiveConnector, ReceiveOptions
from pdmesh.serving.grpc_server import ServiceSpec
from pdmesh.serving.worker_process import serve_worker
from pdmesh.v1 import worker_pb2_grpc

SERVICE = "pdmesh.v1.DecodeWorker"


def kv_options(config: DecodeConfig) -> ReceiveOptions:
    """The receivers this worker's pairs need, as configured: the default transport first."""
    return ReceiveOptions(
        transports=(config.kv_transport, *config.kv_transport_for.values()),
        bind=config.kv_bind,
        advertise=config.kv_advertise,
        transport_for=dict(config.kv_transport_for),
    )


async def serve(config: DecodeConfig, on_ready: Callable[[int], None] | None = None) -> None:
    connector = ReceiveConnector(kv_options(config))
    await serve_worker(
        "decode",
        config,
        connector,
        lambda engine: DecodeWorker(config, connector, engine),
        lambda worker: [
            ServiceSpec(
                SERVICE, worker_pb2_grpc.add_DecodeWorkerServicer_to_server, DecodeServicer(worker)
            )
        ],
        on_ready,
        on_sigterm=(lambda worker: worker.drainer.drain) if config.drain_on_sigterm else None,
    )
