"""A small gRPC client of the router (`pdmesh generate --target`)."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from pdmesh.cli import tls_config
from pdmesh.serving.auth import bearer_metadata
from pdmesh.serving.convert import FINISH_FROM_PB
from pdmesh.serving.grpc_server import channel
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc


def request_from_args(args: argparse.Namespace) -> gen_pb.GenerateRequest:
    sampling = gen_pb.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.sample_seed is not None:
        sampling.seed = args.sample_seed
    if args.chat:
        chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(role="user", content=args.prompt)])
        return gen_pb.GenerateRequest(chat=chat, sampling=sampling)
    return gen_pb.GenerateRequest(text=args.prompt, sampling=sampling)


async def stream_generate(args: argparse.Namespace) -> int:
    async with channel(args.target, tls_config(args)) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        tokens: list[int] = []
        text = ""
        last = None
        try:
            stream = stub.Generate(request_from_args(args), metadata=bearer_metadata(args.api_key))
            async for response in stream:
                tokens.extend(response.token_ids)
                text += response.text
                last = response
                if not args.json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
        except grpc.aio.AioRpcError as e:
            print(f"pdmesh: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() is grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": tokens,
                    "finish_reason": FINISH_FROM_PB[last.finish_reason] if last else None,
                    "usage": {
                        "prompt_tokens": last.usage.prompt_tokens,
                        "completion_tokens": last.usage.completion_tokens,
                        "cached_prompt_tokens": last.usage.cached_prompt_tokens,
                    }
                    if last
                    else None,
                }
            )
        )
    else:
        print()
    return 0
