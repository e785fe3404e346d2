"""gRPC edge of the router: the public `pdmesh.v1.Generation` service."""

from __future__ import annotations

import asyncio

import grpc

from pdmesh.errors import InvalidRequest
from pdmesh.router import metrics
from pdmesh.router.core import Chunk, Router
from pdmesh.serving.convert import FINISH_TO_PB, sampling_fields_from_pb
from pdmesh.serving.errors import status_name
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc
from pdmesh.validation import MaxTokens, Prompt, RequestSpec, deadline_in

GRPC_ENDPOINT = "grpc"  # the `endpoint` label of the router's metrics for gRPC requests
CHAT_FIELD = "chat.messages"


def prompt_from_pb(req: gen_pb.GenerateRequest | gen_pb.TokenizeRequest) -> Prompt:
    """The request's `input` (an empty Prompt when none is set)."""
    kind = req.WhichOneof("input")
    if kind == "text":
        return Prompt(text=req.text)
    if kind == "token_ids":
        return Prompt(token_ids=list(req.token_ids.ids))  # type: ignore[union-attr]
    if kind == "chat":
        return Prompt(messages=[{"role": m.role, "content": m.content} for m in req.chat.messages])
    return Prompt()


def spec_from_pb(req: gen_pb.GenerateRequest, remaining_s: float | None) -> RequestSpec:
    sampling = sampling_fields_from_pb(req.sampling)
    return RequestSpec(
        prompt=prompt_from_pb(req),
        prompt_field=CHAT_FIELD if req.WhichOneof("input") == "chat" else "prompt",
        model=req.model,
        request_id=req.request_id,
        max_tokens=MaxTokens(sampling.pop("max_tokens", None)),
        sampling=sampling,
        deadline=deadline_in(remaining_s),
    )


def chunk_to_pb(chunk: Chunk) -> gen_pb.GenerateResponse:
    pb = gen_pb.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=FINISH_TO_PB[chunk.finish_reason],
    )
    if chunk.usage is not None:
        pb.usage.CopyFrom(chunk.usage)
    if chunk.timings is not None:
        pb.timings.CopyFrom(chunk.timings)
    return pb


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        record = metrics.RequestRecorder(GRPC_ENDPOINT)
        try:
            spec = spec_from_pb(request, context.time_remaining())
            inp = await self.router.validator.validate(spec)
            record.prompt(len(inp.prompt))
            async for chunk in self.router.generate(inp):
                record.tokens(len(chunk.token_ids))
                yield chunk_to_pb(chunk)
        except asyncio.CancelledError:
            record.done(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:
            record.done(status_name(exc))
            raise
        record.done(grpc.StatusCode.OK.name)

    async def GetModelInfo(self, request, context):
        r = self.router
        return gen_pb.ModelInfo(
            name=r.model_name,
            architecture=r.info.architecture,
            vocab_size=r.info.vocab_size,
            max_model_len=r.max_model_len,
            eos_token_ids=list(r.info.eos_token_ids),
            block_size=r.block_size,
            num_prefill_workers=len(r.registry.healthy("prefill")),
            num_decode_workers=len(r.decode_ready()),
        )

    async def Tokenize(self, request, context):
        prompt = prompt_from_pb(request)
        if prompt.text is None and prompt.messages is None:
            raise InvalidRequest("input must be text or chat (none was set).", "input")
        field = CHAT_FIELD if prompt.messages is not None else "prompt"
        ids = await self.router.validator.tokenize(prompt, field)
        return gen_pb.TokenizeResponse(token_ids=ids)
