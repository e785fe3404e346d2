"""gRPC edge of the prefill worker."""

from __future__ import annotations

import dataclasses

from pdmesh.errors import InvalidRequest
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.prefill_service.worker import PrefillTask, PrefillWorker
from pdmesh.serving.convert import sampling_from_pb
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


def task_from_pb(req: worker_pb2.PrefillRequest, default_timeout_s: float) -> PrefillTask:
    if not req.request_id:
        raise InvalidRequest("request_id must not be empty.", "request_id")
    return PrefillTask(
        request_id=req.request_id,
        prompt=list(req.prompt_token_ids),
        params=sampling_from_pb(req.sampling),
        target=KVTarget.from_pb(req.kv_target, default_timeout_s),
    )


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        out = await self.worker.prefill(task_from_pb(request, self.worker.config.kv_send_timeout_s))
        return worker_pb2.PrefillReply(**dataclasses.asdict(out))

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(**await self.worker.report())
