"""A model-free decode worker: speaks the DecodeWorker protocol and emits tokens with no model
behind them, to measure what the router can relay (bench/relay.py).

Like a real decode worker, its "engine" steps on a clock (every `step_s`), one token per active
request per step, whether or not the last message has been sent; when the router reads slower
than that, the steps that happened meanwhile go out together in the next StepUpdate (one delta
per request per step, as the real worker's servicer coalesces them). `step_s` 0 is one step per
message, as fast as the stream takes them. A request ends with finish_reason LENGTH at its
max_tokens, with usage. A request's one-token delta never changes, so it is serialised once at
Submit and a message is a byte join: the source stays cheap next to the router it measures.

    python -m pdmesh.bench.token_source --port 50061 [--step-ms 1]
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdmesh.errors import FailedPrecondition, InvalidRequest
from pdmesh.serving.grpc_server import ServiceSpec, build_server
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import worker_pb2

SERVICE = "pdmesh.v1.DecodeWorker"
BLOCK_SIZE = 16
FIRST_TOKEN_ID = 1000  # token ids cycle over a range of ordinary (non-special) ids
TOKEN_ID_RANGE = 1000
MAX_STEPS_PER_MESSAGE = 64  # a stalled reader gets its backlog in bounded messages


def _frame(delta: worker_pb2.RequestDelta) -> bytes:
    """`delta` as one element of a serialised StepUpdate.deltas: StepUpdates concatenate."""
    return worker_pb2.StepUpdate(deltas=[delta]).SerializeToString()


@dataclass
class Active:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    step_bytes: bytes  # this request's framed one-token delta
    token_id: int
    sent: int = 0


@dataclass
class Subscriber:
    requests: dict[str, Active] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class TokenSource:
    """The DecodeWorker servicer (Submit, Subscribe, Abort, GetStats) and its state: subscribers
    and their active requests."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.subscribers: dict[str, Subscriber] = {}
        self.owner: dict[str, str] = {}  # request id -> subscriber id

    async def Submit(
        self, req: worker_pb2.DecodeRequest, context: object
    ) -> worker_pb2.SubmitReply:
        sub = self.subscribers.get(req.subscriber_id)
        if sub is None:
            raise FailedPrecondition(
                f"subscriber {req.subscriber_id!r} has no open Subscribe stream; subscribe first",
            )
        if not req.request_id or req.request_id in self.owner:
            raise InvalidRequest(
                f"request_id {req.request_id!r} is empty or already in use.", "request_id"
            )
        max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 16
        token_id = FIRST_TOKEN_ID + len(self.owner) % TOKEN_ID_RANGE
        delta = worker_pb2.RequestDelta(
            request_id=req.request_id, token_ids=[token_id], text=f" t{token_id}"
        )
        n_prompt = len(req.prompt_token_ids)
        active = Active(req.request_id, n_prompt, max(1, max_tokens), _frame(delta), token_id)
        sub.requests[req.request_id] = active
        self.owner[req.request_id] = req.subscriber_id
        sub.wake.set()
        return worker_pb2.SubmitReply()

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: object
    ) -> worker_pb2.AbortReply:
        aborted = 0
        for rid in request.request_ids:
            sub_id = self.owner.pop(rid, None)
            sub = self.subscribers.get(sub_id or "")
            if sub is not None and sub.requests.pop(rid, None) is not None:
                aborted += 1
        return worker_pb2.AbortReply(aborted=aborted)

    def steps(self, sub: Subscriber, n: int) -> bytes:
        """`n` steps of every active request of `sub`, serialised as one StepUpdate."""
        parts: list[bytes] = []
        finished: list[Active] = []
        for a in sub.requests.values():
            k = min(n, a.max_tokens - a.sent)
            a.sent += k
            if a.sent < a.max_tokens:
                parts.append(a.step_bytes * k)
            else:
                parts.append(a.step_bytes * (k - 1))
                finished.append(a)
        for a in finished:
            del sub.requests[a.request_id]
            self.owner.pop(a.request_id, None)
            parts.append(_frame(self._last_delta(a)))
        return b"".join(parts)

    @staticmethod
    def _last_delta(a: Active) -> worker_pb2.RequestDelta:
        return worker_pb2.RequestDelta(
            request_id=a.request_id,
            token_ids=[a.token_id],
            text=f" t{a.token_id}",
            finish_reason=gen_pb.FINISH_REASON_LENGTH,
            usage=gen_pb.Usage(prompt_tokens=a.prompt_tokens, completion_tokens=a.sent),
            timings=gen_pb.Timings(),
        )

    async def Subscribe(
        self, request: worker_pb2.SubscribeRequest, context: object
    ) -> AsyncIterator[bytes]:
        subscriber_id = request.subscriber_id
        if not subscriber_id:
            raise ValueError("subscriber_id must not be empty.")
        sub = Subscriber()
        self.subscribers[subscriber_id] = sub
        try:
            yield b""  # the handshake: an empty StepUpdate
            loop = asyncio.get_running_loop()
            clock = loop.time()  # when the next step is due
            while True:
                if not sub.requests:
                    sub.wake.clear()
                    await sub.wake.wait()
                    clock = loop.time()
                n = 1
                if self.step_s > 0:
                    # The steps that fell due while the last message was being sent.
                    due = int((loop.time() - clock) / self.step_s) + 1
                    n = min(MAX_STEPS_PER_MESSAGE, max(1, due))
                    clock = max(clock + n * self.step_s, loop.time() - self.step_s)
                yield self.steps(sub, n)
                # A pause lets Submit/Abort in; with step_s == 0 it is a bare yield to the loop.
                await asyncio.sleep(max(0.0, clock - loop.time()))
        finally:
            if self.subscribers.get(subscriber_id) is sub:
                del self.subscribers[subscriber_id]
            for rid in sub.requests:
                self.owner.pop(rid, None)

    async def GetStats(self, request: object, context: object) -> worker_pb2.WorkerStats:
        running = sum(len(s.requests) for s in self.subscribers.values())
        blocks = {"kv_blocks_total": 1 << 20, "kv_blocks_used": 0, "kv_blocks_free": 1 << 20}
        return worker_pb2.WorkerStats(
            role="decode",
            num_running=running,
            **blocks,
            block_size=BLOCK_SIZE,
            tensor_parallel_size=1,
        )


def add_to_server(servicer: TokenSource, server: grpc.aio.Server) -> None:
    """DecodeWorker's handlers, with Subscribe sending pre-serialised StepUpdate bytes."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    rpcs = {  # name: (handler kind, request type, response serializer)
        "Submit": (unary, worker_pb2.DecodeRequest, worker_pb2.SubmitReply.SerializeToString),
        "Subscribe": (stream, worker_pb2.SubscribeRequest, bytes),
        "Abort": (unary, worker_pb2.AbortRequest, worker_pb2.AbortReply.SerializeToString),
        "GetStats": (unary, worker_pb2.StatsRequest, worker_pb2.WorkerStats.SerializeToString),
    }
    handlers = {
        name: kind(getattr(servicer, name), request.FromString, serialize)
        for name, (kind, request, serialize) in rpcs.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def serve(bind: str, step_s: float) -> None:
    source = TokenSource(step_s)
    server, health, port = build_server(bind, [ServiceSpec(SERVICE, add_to_server, source)])
    await server.start()
    print(f"token source on port {port}", flush=True)
    await serve_until_stopped(server, health, lambda: asyncio.sleep(0))  # nothing to clean up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--step-ms", type=float, default=1.0, help="time between steps (0: none)")
    args = p.parse_args()
    if args.step_ms < 0:
        raise SystemExit("--step-ms must be >= 0")
    asyncio.run(serve(f"{args.host}:{args.port}", args.step_ms / 1000))


if __name__ == "__main__":
    main()
