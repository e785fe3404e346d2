"""gRPC edge of the router: the public `pdmesh.v1.Generation` service."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from pdmesh.router import metrics
from pdmesh.router.core import Chunk, GenerationInput, Router
from pdmesh.serving.convert import FINISH_TO_PB, sampling_from_pb
from pdmesh.serving.errors import status_of
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

MAX_REQUEST_ID_LEN = 256
GRPC_ENDPOINT = "grpc"  # the `endpoint` label of the router's metrics for gRPC requests


def messages_from_pb(chat: gen_pb.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


async def input_from_pb(
    router: Router, req: gen_pb.GenerateRequest, remaining_s: float | None
) -> GenerationInput:
    router.check_model(req.model)
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters.")
    params = sampling_from_pb(req.sampling, max_tokens_cap=router.max_model_len)
    kind = req.WhichOneof("input")
    if kind == "text":
        prompt = await router.tokenize(req.text)
    elif kind == "token_ids":
        prompt = list(req.token_ids.ids)
    elif kind == "chat":
        prompt = await router.tokenize_chat(messages_from_pb(req.chat))
    else:
        raise ValueError("input must be one of text, token_ids or chat (none was set).")
    return GenerationInput(
        request_id=req.request_id or uuid.uuid4().hex,
        prompt=prompt,
        params=params,
        deadline=time.time() + remaining_s if remaining_s is not None else None,
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
            inp = await input_from_pb(self.router, request, context.time_remaining())
            record.prompt(len(inp.prompt))
            async for chunk in self.router.generate(inp):
                record.tokens(len(chunk.token_ids))
                yield chunk_to_pb(chunk)
        except asyncio.CancelledError:
            record.done(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:
            record.done(status_of(exc)[0].name)
            raise
        record.done(grpc.StatusCode.OK.name)

    async def GetModelInfo(self, request, context):
        r = self.router
        return gen_pb.ModelInfo(
            name=r.model_name,
            architecture=type(r.info.hf_config).__name__.removesuffix("Config"),
            vocab_size=r.info.vocab_size,
            max_model_len=r.max_model_len,
            eos_token_ids=list(r.info.eos_token_ids),
            block_size=r.block_size,
            num_prefill_workers=len(r.registry.healthy("prefill")),
            num_decode_workers=len(r.decode_ready()),
        )

    async def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind == "text":
            ids = await self.router.tokenize(request.text)
        elif kind == "chat":
            ids = await self.router.tokenize_chat(messages_from_pb(request.chat))
        else:
            raise ValueError("input must be text or chat (none was set).")
        return gen_pb.TokenizeResponse(token_ids=ids)
