"""The CLI's gRPC clients of the router: `pdmesh generate --target` streaming one request, and
`RouterClient`, how `pdmesh up` and the benchmarks ask a router whether it is ready and a
question."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import grpc

from pdmesh.flags import tls_config
from pdmesh.serving.auth import ApiKeys, bearer_metadata
from pdmesh.serving.convert import FINISH_FROM_PB
from pdmesh.serving.grpc_server import blocking_channel, channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc


@dataclass(frozen=True)
class RouterClient:
    """How this process reaches a router: address, TLS, an API key."""

    target: str
    tls: TLSConfig | None = None
    api_key: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterClient:
        """The router of `--host`/`--port`, with the TLS flags and the first of `--api-keys`
        (ValueError naming a bad TLS file or key file)."""
        keys = ApiKeys.from_flags(args.api_keys, args.api_keys_file)
        return cls(
            f"{args.host}:{args.port}", tls_config(args), keys.keys[0] if keys.keys else None
        )

    def channel(self) -> grpc.Channel:
        return blocking_channel(self.target, self.tls)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.api_key)

    def has_workers(self, prefill: int, decode: int) -> bool:
        """Whether the router has at least this many workers in rotation (False while it does
        not answer)."""
        with self.channel() as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            try:
                info = stub.GetModelInfo(
                    gen_pb.ModelInfoRequest(), timeout=2, metadata=self.metadata
                )
            except grpc.RpcError:
                return False
        return info.num_prefill_workers >= prefill and info.num_decode_workers >= decode

    def ask(self, question: str) -> str:
        """One chat turn, greedy, at most 64 tokens: the answer's text."""
        with self.channel() as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(role="user", content=question)])
            req = gen_pb.GenerateRequest(
                chat=chat, sampling=gen_pb.SamplingParams(max_tokens=64, temperature=0)
            )
            stream = stub.Generate(req, timeout=120, metadata=self.metadata)
            return "".join(r.text for r in stream)


def request_from_args(args: argparse.Namespace) -> gen_pb.GenerateRequest:
    """The request the sampling flags and `--prompt` / `--chat` of `pdmesh generate` describe."""
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
        usage = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
        result = {
            "text": text,
            "token_ids": tokens,
            "finish_reason": FINISH_FROM_PB[last.finish_reason] if last else None,
            "usage": {k: getattr(last.usage, k) for k in usage} if last else None,
        }
        print(json.dumps(result))
    else:
        print()
    return 0
