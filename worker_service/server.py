"""`pdmesh worker --role ROLE`: one worker process that takes either role. It serves the decode
and the prefill services (and WorkerRole) on one port; what it accepts is its role's."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.decode_service.server import SERVICE as DECODE_SERVICE
from pdmesh.decode_service.server import kv_options
from pdmesh.decode_service.servicer import DecodeServicer
from pdmesh.kv_transfer.push_receive_connector import PushReceiveConnector, PushReceiveOptions
from pdmesh.prefill_service.server import SERVICE as PREFILL_SERVICE
from pdmesh.prefill_service.servicer import PrefillServicer
from pdmesh.serving.grpc_server import ServiceSpec
from pdmesh.serving.worker_process import serve_worker
from pdmesh.v1 import worker_pb2_grpc
from pdmesh.worker_service.config import WorkerConfig
from pdmesh.worker_service.servicer import RoleServicer
from pdmesh.worker_service.worker import RoleWorker

SERVICE = "pdmesh.v1.WorkerRole"


async def serve(config: WorkerConfig, on_ready: Callable[[int], None] | None = None) -> None:
    connector = PushReceiveConnector(PushReceiveOptions(kv_options(config)))
    await serve_worker(
        "role-switching",  # its log lines and its traces (service pdmesh-role-switching)
        config,
        connector,
        lambda engine: RoleWorker(config, connector, engine),
        lambda worker: [
            ServiceSpec(
                DECODE_SERVICE,
                worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
                DecodeServicer(worker),
            ),
            ServiceSpec(
                PREFILL_SERVICE,
                worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
                PrefillServicer(worker),
            ),
            ServiceSpec(
                SERVICE, worker_pb2_grpc.add_WorkerRoleServicer_to_server, RoleServicer(worker)
            ),
        ],
        on_ready,
        on_sigterm=(lambda worker: worker.drain) if config.drain_on_sigterm else None,
    )
