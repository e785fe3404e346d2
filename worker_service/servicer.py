"""gRPC edge of a worker's role switch (`pdmesh.v1.WorkerRole`)."""

from __future__ import annotations

import dataclasses

from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from pdmesh.worker_service.worker import RoleWorker


class RoleServicer(worker_pb2_grpc.WorkerRoleServicer):
    def __init__(self, worker: RoleWorker) -> None:
        self.worker = worker

    async def SetRole(self, request, context):
        change = await self.worker.set_role(request.role)
        return worker_pb2.SetRoleReply(**dataclasses.asdict(change))
