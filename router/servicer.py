"""gRPC edge of the router: the public `pdmesh.v1.Generation` service."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdmesh.errors import InvalidRequest
from pdmesh.router import metrics
from pdmesh.router.core import Router
from pdmesh.serving.convert import sampling_fields_from_pb
from pdmesh.serving.errors import status_name
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc
from pdmesh.validation import Prompt, RequestSpec

GRPC_ENDPOINT = "grpc"  # the `endpoint` label of the router's metrics for gRPC requests
CHAT_FIELD = "chat.messages"


def prompt_from_pb(req: gen_pb.GenerateRequest | gen_pb.TokenizeRequest) -> tuple[Prompt, str]:
    """The request's `input` (an empty Prompt when none is set) and its field's name."""
    kind = req.WhichOneof("input")
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        return Prompt(messages=messages), CHAT_FIELD
    if kind == "token_ids":
        return Prompt(token_ids=list(req.token_ids.ids)), "prompt"  # type: ignore[union-attr]
    return Prompt(text=req.text if kind == "text" else None), "prompt"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        record = metrics.RequestRecorder(GRPC_ENDPOINT)
        try:
            sampling = sampling_fields_from_pb(request.sampling)
            prompt, prompt_field = prompt_from_pb(request)
            remaining_s = context.time_remaining()
            spec = RequestSpec(
                prompt=prompt,
                prompt_field=prompt_field,
                model=request.model,
                request_id=request.request_id,
                max_tokens=sampling.pop("max_tokens", None),
                sampling=sampling,
                deadline=time.time() + remaining_s if remaining_s is not None else None,
            )
            inp = await self.router.validator.validate(spec)
            record.prompt(len(inp.prompt))
            async for chunk in self.router.generate(inp):
                record.tokens(len(chunk.token_ids))
                yield chunk
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
            block_size=r.dispatcher.block_size,
            num_prefill_workers=len(r.registry.healthy("prefill")),
            num_decode_workers=len(r.dispatcher.decode_ready()),
        )

    async def Tokenize(self, request, context):
        prompt, field = prompt_from_pb(request)
        if prompt.text is None and prompt.messages is None:
            raise InvalidRequest("input must be text or chat (none was set).", "input")
        ids = await self.router.validator.tokenize(prompt, field)
        return gen_pb.TokenizeResponse(token_ids=ids)
