"""gRPC edge of the decode worker: protobuf in, domain calls, protobuf out."""

from __future__ import annotations

import dataclasses
import time

import grpc

from pdmesh.decode_service.types import Delta, MigrateFrom, Submission
from pdmesh.decode_service.worker import DecodeWorker
from pdmesh.errors import InvalidRequest
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.serving.convert import (
    FINISH_TO_PB,
    logprobs_to_pb,
    prompt_logprobs_to_pb,
    sampling_from_pb,
)
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


def submission_from_pb(req: worker_pb2.DecodeRequest) -> Submission:
    if not req.request_id:
        raise InvalidRequest("request_id must not be empty.", "request_id")
    return Submission(
        request_id=req.request_id,
        subscriber_id=req.subscriber_id,
        prompt=list(req.prompt_token_ids),
        params=sampling_from_pb(req.sampling),
        prefill_address=req.prefill_address or None,
        disagg_min_tokens=req.disagg_min_tokens,
        deadline=req.deadline_unix_ms / 1000 if req.deadline_unix_ms > 0 else None,
        arrival_ns=req.arrival_unix_ns or time.time_ns(),
        num_output_tokens_sent=req.num_output_tokens_sent,
        migrate_from=_migrate_from(req),
    )


def _migrate_from(req: worker_pb2.DecodeRequest) -> MigrateFrom | None:
    if not req.HasField("migrate_from"):
        return None
    source = req.migrate_from
    if not source.address or not source.handle:
        raise InvalidRequest("migrate_from needs an address and a handle.", "migrate_from")
    if req.num_output_tokens_sent < 1:
        raise InvalidRequest(
            "a migrating request has output: num_output_tokens_sent must be >= 1.",
            "num_output_tokens_sent",
        )
    return MigrateFrom(source.address, source.handle)


def delta_to_pb(d: Delta) -> worker_pb2.RequestDelta:
    pb = worker_pb2.RequestDelta(
        request_id=d.request_id,
        token_ids=d.token_ids,
        text=d.text,
        finish_reason=FINISH_TO_PB[d.finish_reason],
        # The wire carries the status code's number (0: no error).
        error_code=grpc.StatusCode[d.error_status].value[0] if d.error_status else 0,
        error_message=d.error_message,
        error_field=d.error_field,
        index=d.index,
    )
    if d.moved is not None:
        pb.moved.SetInParent()  # present even with no handle
        pb.moved.handle = d.moved
    if d.logprobs is not None:
        pb.logprobs.extend(logprobs_to_pb(p) for p in d.logprobs)
    if d.prompt_logprobs is not None:
        pb.prompt_logprobs.extend(prompt_logprobs_to_pb(d.prompt_logprobs))
    if d.usage is not None:
        pb.usage.CopyFrom(gen_pb.Usage(**dataclasses.asdict(d.usage)))
    if d.timings is not None:
        # uint64 on the wire: a wall clock stepping back must not make a duration negative.
        timings = {k: max(0, v) for k, v in dataclasses.asdict(d.timings).items()}
        pb.timings.CopyFrom(gen_pb.Timings(**timings))
    return pb


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Submit(self, request, context):
        await self.worker.submit(submission_from_pb(request))
        return worker_pb2.SubmitReply()

    async def Subscribe(self, request, context):
        queue = self.worker.subscribe(request.subscriber_id)
        try:
            yield worker_pb2.StepUpdate()  # the handshake: this subscriber is registered now
            ending = False
            while not ending:
                deltas = await queue.get()
                if deltas is None:  # the worker is stopping
                    return
                # Coalesce steps that piled up while the previous message was being sent.
                while not queue.empty():
                    more = queue.get_nowait()
                    if more is None:
                        ending = True
                        break
                    deltas.extend(more)
                yield worker_pb2.StepUpdate(deltas=[delta_to_pb(d) for d in deltas])
        finally:
            await self.worker.unsubscribe(request.subscriber_id, queue)

    async def Abort(self, request, context):
        return worker_pb2.AbortReply(aborted=await self.worker.abort(list(request.request_ids)))

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(**await self.worker.report())

    async def Drain(self, request, context):
        report = await self.worker.drainer.drain()
        return worker_pb2.DrainReply(migrated=report.migrated, recomputed=report.recomputed)

    async def Migrate(self, request, context):
        target = None
        if request.HasField("kv_target"):
            target = KVTarget.from_pb(request.kv_target, self.worker.config.kv_timeout_s)
        nbytes = await self.worker.drainer.migrate(request.handle, target, list(request.token_ids))
        return worker_pb2.MigrateReply(kv_bytes=nbytes)
