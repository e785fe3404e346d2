"""gRPC edge of the prefill worker."""

from __future__ import annotations

from typing import Any, Protocol

from pdmesh.errors import InvalidRequest
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.prefill_service.worker import PrefillOutcome, Prefills, PrefillTask
from pdmesh.serving.convert import logprobs_to_pb, prompt_logprobs_to_pb, sampling_from_pb
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


def outcome_to_pb(out: PrefillOutcome) -> worker_pb2.PrefillReply:
    pb = worker_pb2.PrefillReply(
        first_token_id=out.first_token_id,
        cached_prompt_tokens=out.cached_prompt_tokens,
        prefill_ns=out.prefill_ns,
        kv_bytes=out.kv_bytes,
        kv_send_ns=out.kv_send_ns,
        first_token_ids=out.first_token_ids or (),
    )
    pb.first_token_logprobs.extend(logprobs_to_pb(p) for p in out.first_token_logprobs or ())
    pb.prompt_logprobs.extend(prompt_logprobs_to_pb(out.prompt_logprobs or []))
    return pb


class PrefillServing(Protocol):
    """What the servicer needs of its worker: a prefill worker, or one that switches roles."""

    requests: Prefills

    async def report(self) -> dict[str, Any]: ...


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillServing) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        requests = self.worker.requests
        out = await requests.prefill(task_from_pb(request, requests.timeout_s))
        return outcome_to_pb(out)

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(**await self.worker.report())
