"""gRPC edge of the router: the public `pdmesh.v1.Generation` service."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from pdmesh.errors import InvalidRequest
from pdmesh.router import metrics
from pdmesh.router.chat_pb import CallsAtEnd, messages_from_pb, tool_use_from_pb, tools_from_pb
from pdmesh.router.core import Router
from pdmesh.router.tool_choice import NONE
from pdmesh.router.tool_parsers.registry import pick_parser
from pdmesh.sampling_params import SamplingParams
from pdmesh.serving.convert import sampling_fields_from_pb
from pdmesh.serving.errors import status_name
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2_grpc
from pdmesh.validation import Prompt, RequestSpec

GRPC_ENDPOINT = "grpc"  # the `endpoint` label of the router's metrics for gRPC requests
CHAT_FIELD = "chat.messages"
TOOLS_FIELD = "chat.tools"


def prompt_from_pb(req: gen_pb.GenerateRequest | gen_pb.TokenizeRequest) -> tuple[Prompt, str]:
    """The request's `input` (an empty Prompt when none is set) and its field's name."""
    kind = req.WhichOneof("input")
    if kind == "chat":
        tools = tools_from_pb(req.chat) or None
        prompt = Prompt(messages=messages_from_pb(req.chat), tools=tools, tools_field=TOOLS_FIELD)
        return prompt, CHAT_FIELD
    if kind == "token_ids":
        return Prompt(token_ids=list(req.token_ids.ids)), "prompt"  # type: ignore[union-attr]
    return Prompt(text=req.text if kind == "text" else None), "prompt"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        # The model's tool-call format, for tool_choice "auto".
        template = router.validator.tokenizer.chat_template
        self.tool_format = pick_parser(router.config.tool_call_parser, template)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        record = metrics.RequestRecorder(GRPC_ENDPOINT)
        calls: CallsAtEnd | None = None
        try:
            sampling = sampling_fields_from_pb(request.sampling)
            prompt, prompt_field = prompt_from_pb(request)
            calls = self._tool_calls(request, prompt, sampling)
            remaining_s = context.time_remaining()
            spec = RequestSpec(
                prompt=prompt,
                prompt_field=prompt_field,
                model=request.model,
                request_id=request.request_id,
                max_tokens=sampling.pop("max_tokens", None),
                # As HTTP: prompt + max_tokens must fit in the model's length (unset: 16, at
                # most what fits).
                must_fit=True,
                default_max_tokens=SamplingParams.max_tokens,
                sampling=sampling,
                deadline=time.time() + remaining_s if remaining_s is not None else None,
            )
            inp = await self.router.validator.validate(spec)
            record.prompt(len(inp.prompt))
            async for chunk in self.router.generate(inp):
                record.tokens(len(chunk.token_ids))
                if calls is not None:
                    calls.see(chunk)
                yield chunk
        except asyncio.CancelledError:
            record.done(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as exc:
            record.done(status_name(exc))
            refusal = calls.tools.refusal(exc) if calls is not None else exc
            if refusal is not exc:
                raise refusal from None
            raise
        record.done(grpc.StatusCode.OK.name)

    def _tool_calls(
        self, request: gen_pb.GenerateRequest, prompt: Prompt, sampling: dict[str, Any]
    ) -> CallsAtEnd | None:
        """For a chat with tools: their constraint put on `sampling`, and what parses the calls
        (None: no tools, or tool_choice "none")."""
        tools = tool_use_from_pb(request.chat, prompt.tools or []) if prompt.messages else None
        if tools is None:
            return None
        tools.constrain(sampling)
        return CallsAtEnd(tools, self.tool_format) if tools.choice != NONE else None

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


class MeshControlServicer(worker_pb2_grpc.MeshControlServicer):
    """The router's control of its workers (operators, `pdmesh role`)."""

    def __init__(self, router: Router) -> None:
        self.roles = router.roles

    async def SetWorkerRole(self, request, context):
        return await self.roles.set_role(request.worker, request.role)
