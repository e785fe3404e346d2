"""gRPC edge of the prefill worker."""

from __future__ import annotations

import grpc

from pdmesh.kv_transfer import TransferError
from pdmesh.prefill_service.worker import Destination, PrefillTask, PrefillWorker
from pdmesh.serving.convert import sampling_from_pb, worker_stat_fields
from pdmesh.serving.errors import ServiceError
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


def task_from_pb(req: worker_pb2.PrefillRequest, default_timeout_s: float) -> PrefillTask:
    if not req.request_id:
        raise ValueError("request_id must not be empty.")
    target = req.kv_target
    return PrefillTask(
        request_id=req.request_id,
        prompt=list(req.prompt_token_ids),
        params=sampling_from_pb(req.sampling),
        transport=target.transport,
        transfer_id=target.transfer_id,
        token=target.token,
        first_block=target.first_block,
        num_blocks=len(target.block_ids),
        block_size=target.block_size,
        destinations=[Destination(e.address, e.head_start, e.num_heads) for e in target.endpoints],
        timeout_s=target.timeout_ms / 1000 if target.timeout_ms else default_timeout_s,
        trace_context=dict(target.trace_context),
    )


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        task = task_from_pb(request, self.worker.config.kv_send_timeout_s)
        try:
            out = await self.worker.prefill(task)
        except TransferError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}") from None
        return worker_pb2.PrefillReply(
            first_token_id=out.first_token,
            cached_prompt_tokens=out.cached_prompt_tokens,
            prefill_ns=out.prefill_ns,
            kv_bytes=out.kv_bytes,
            kv_send_ns=out.kv_send_ns,
        )

    async def GetStats(self, request, context):
        s = await self.worker.stats()
        e = s["engine"]
        return worker_pb2.WorkerStats(
            role="prefill",
            **worker_stat_fields(e),
            kv_bytes_sent=s["kv_bytes_sent"],
            kv_seconds=s["kv_seconds"],
            kv_transfers=s["kv_transfers"],
            remote_prefills=self.worker.prefills,
            expert_token_counts=s["expert_token_counts"],
            block_size=self.worker.geometry.block_size,
            tensor_parallel_size=1,
        )
