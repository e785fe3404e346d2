"""Submitting a request to a decode worker: pick the workers (the dispatch policy), book their
load, send `Submit`, and move on to another decode worker while one is unreachable or its queue
is full. One submission is an `Attempt`; `Dispatcher.end` undoes its booking (and aborts it on
its worker unless it finished there).

This is the router's gRPC client edge toward decode workers: their status codes become
`pdmesh.errors` here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pdmesh.errors import Overloaded, Unavailable, from_status
from pdmesh.logger import get_logger
from pdmesh.prefix_hash import hash_prefix_blocks
from pdmesh.router.config import RouterConfig
from pdmesh.router.decode_link import DecodeLink, DeltaQueue, LinkLost
from pdmesh.router.policies import Decision, DispatchPolicy, PromptInfo
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.router.request_telemetry import RequestTelemetry
from pdmesh.serving.convert import sampling_to_pb
from pdmesh.v1 import worker_pb2
from pdmesh.validation import ValidRequest

log = get_logger(__name__)

SUBMIT_TIMEOUT_S = 10.0
LINK_WAIT_S = 2.0  # how long a request waits for a decode worker's stream to (re)open
DEFAULT_BLOCK_SIZE = 16
# Submit errors after which another decode worker may take the request: the worker is
# unreachable, its engine failed or it is shutting down (CANCELLED: the router never cancels a
# Submit itself), or its token stream to this router is being reopened.
_RETRY_SUBMIT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


@dataclass(eq=False)
class Attempt:
    """One submission of a request to a decode worker, and the load the router booked for it.
    `finished`: its last chunk was relayed; `lost`: its worker's stream broke first."""

    link: DecodeLink
    decode: Worker
    prefill: Worker | None
    wire_id: str  # the request's id on the decode worker
    queue: DeltaQueue
    blocks: int
    prefill_blocks: int
    finished: bool = False
    lost: LinkLost | None = None

    @classmethod
    def begin(cls, link: DecodeLink, decision: Decision, wire_id: str, blocks: int) -> Attempt:
        decision.decode.inflight_blocks += blocks
        if decision.prefill is not None:
            decision.prefill.inflight_blocks += decision.prefill_miss_blocks
        queue = link.register(wire_id)
        return cls(
            link,
            decision.decode,
            decision.prefill,
            wire_id,
            queue,
            blocks,
            decision.prefill_miss_blocks,
        )

    def first_tokens(self) -> None:
        """The prefill is over (tokens came, or the attempt ended): release its booking."""
        if self.prefill is not None:
            self.prefill.inflight_blocks -= self.prefill_blocks
            self.prefill = None


class Dispatcher:
    """Decode links, worker choice and submission for one router."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        policy: DispatchPolicy,
        router_id: str,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.links = {w.address: DecodeLink(w, router_id) for w in registry.by_role("decode")}
        self._background: set[asyncio.Task[Any]] = set()
        self._submits = 0

    def start(self) -> None:
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()

    def decode_ready(self) -> list[Worker]:
        """Decode workers in rotation whose token stream to this router is open."""
        healthy = self.registry.healthy("decode")
        return [w for w in healthy if self.links[w.address].connected.is_set()]

    async def ready_decode_workers(self, wait_s: float) -> list[Worker]:
        """Ready decode workers; if none, wait up to `wait_s` for one (a link reconnecting)."""
        loop = asyncio.get_running_loop()
        ready = self.decode_ready()
        deadline = loop.time() + wait_s
        while not ready and loop.time() < deadline:
            await asyncio.sleep(0.05)
            ready = self.decode_ready()
        return ready

    @property
    def block_size(self) -> int:
        sizes = [w.load.block_size for w in self.registry.by_role("decode") if w.load.block_size]
        return sizes[0] if sizes else DEFAULT_BLOCK_SIZE

    async def submit(
        self,
        inp: ValidRequest,
        sent: list[int],
        lost: set[str],
        telemetry: RequestTelemetry,
    ) -> Attempt:
        """Submit `inp` with the tokens already `sent` to the client appended to its prompt
        (they count as output), avoiding the decode workers in `lost`. Overloaded when every
        decode worker's queue is full, Unavailable when none is there to take it."""
        prompt_ids = inp.prompt + sent if sent else inp.prompt
        bs = self.block_size
        prompt = PromptInfo(len(prompt_ids), hash_prefix_blocks(prompt_ids, bs), bs)
        refused: set[str] = set()  # queue full
        unreachable: set[str] = set()
        failures = 0  # Submits that failed for want of a worker (a worker may fail twice)
        while True:
            decode = await self._candidates(lost | unreachable, refused)
            if not decode:
                if refused:
                    raise Overloaded("every decode worker's queue is full; retry later.")
                telemetry.no_worker()
                raise Unavailable("no decode worker is available; retry later.")
            decision = self.policy.choose(prompt, decode, self.registry.healthy("prefill"))
            telemetry.dispatched(decision)
            self._submits += 1
            resumed = bool(sent) or bool(refused or unreachable)
            attempt = Attempt.begin(
                self.links[decision.decode.address],
                decision,
                f"{inp.request_id}~{self._submits}" if resumed else inp.request_id,
                prompt.num_blocks,
            )
            try:
                with telemetry.active():
                    await attempt.decode.stub.Submit(  # type: ignore[attr-defined]
                        self._request(inp, attempt, prompt_ids, len(sent)),
                        timeout=SUBMIT_TIMEOUT_S,
                    )
            except grpc.aio.AioRpcError as e:
                self.end(attempt)
                code = e.code()
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.add(attempt.decode.address)
                    telemetry.failover("queue_full")
                    continue
                if code in _RETRY_SUBMIT and failures < self.config.max_failovers:
                    failures += 1
                    unreachable.add(attempt.decode.address)
                    telemetry.failover("submit_failed")
                    continue
                raise from_status(code.name, e.details() or "decode worker refused") from None
            attempt.decode.index.insert(prompt.block_hashes)
            if attempt.prefill is not None:
                attempt.prefill.index.insert(prompt.block_hashes)
            return attempt

    def _request(
        self, inp: ValidRequest, attempt: Attempt, prompt_ids: list[int], num_sent: int
    ) -> worker_pb2.DecodeRequest:
        return worker_pb2.DecodeRequest(
            request_id=attempt.wire_id,
            subscriber_id=attempt.link.subscriber_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling_to_pb(inp.params),
            prefill_address=attempt.prefill.address if attempt.prefill is not None else "",
            disagg_min_tokens=self.config.disagg_min_tokens,
            deadline_unix_ms=int(inp.deadline * 1000) if inp.deadline else 0,
            arrival_unix_ns=time.time_ns(),
            num_output_tokens_sent=num_sent,
        )

    async def _candidates(self, avoid: set[str], refused: set[str]) -> list[Worker]:
        """Ready decode workers, preferring those not in `avoid` (waiting a little for one);
        a worker in `avoid` serves again if it is the only one back. Never one in `refused`."""
        ready = await self.ready_decode_workers(LINK_WAIT_S)
        ready = [w for w in ready if w.address not in refused]
        if not avoid:
            return ready
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINK_WAIT_S
        while True:
            fresh = [w for w in ready if w.address not in avoid]
            if fresh or loop.time() >= deadline:
                return fresh or ready
            await asyncio.sleep(0.05)
            ready = [w for w in self.decode_ready() if w.address not in refused]

    def end(self, attempt: Attempt) -> None:
        """Undo an attempt's bookkeeping; abort it on its worker unless it finished there."""
        attempt.link.unregister(attempt.wire_id)
        attempt.decode.inflight_blocks -= attempt.blocks
        attempt.first_tokens()
        if not attempt.finished:  # the client left, or the worker was lost or refused it
            task = asyncio.get_running_loop().create_task(
                _abort(attempt.decode.stub, attempt.wire_id)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)


async def _abort(stub: Any, request_id: str) -> None:
    try:
        await stub.Abort(worker_pb2.AbortRequest(request_ids=[request_id]), timeout=5)
    except grpc.aio.AioRpcError as e:
        log.debug("abort of %s failed: %s", request_id, e.code())
