"""The router: tokenizes once, picks the workers, submits to the decode worker and relays its
tokens. Shared by the gRPC API and the HTTP gateway."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdmesh.engine.model_info import ModelInfo
from pdmesh.engine.model_source import model_display_name
from pdmesh.engine.prefix_hash import hash_prefix_blocks
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.logger import get_logger
from pdmesh.router.config import RouterConfig
from pdmesh.router.decode_link import DecodeLink, DeltaQueue, LinkLost
from pdmesh.router.policies import Decision, DispatchPolicy, PromptInfo
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.router.request_telemetry import RequestTelemetry
from pdmesh.router.stream_pacing import StreamPacer
from pdmesh.router.tokenization import RouterTokenizer
from pdmesh.serving.convert import FINISH_FROM_PB, sampling_to_pb
from pdmesh.serving.errors import ServiceError
from pdmesh.v1 import worker_pb2

log = get_logger(__name__)

_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
SUBMIT_TIMEOUT_S = 10.0
LINK_WAIT_S = 2.0  # how long a request waits for a decode worker's stream to (re)open
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class GenerationInput:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float | None = None  # unix seconds


@dataclass
class Chunk:
    """What a client receives at once: new tokens and text, and on the last the outcome."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Any = None  # pdmesh.v1.Usage on the last chunk
    timings: Any = None  # pdmesh.v1.Timings on the last chunk


class Router:
    def __init__(
        self,
        config: RouterConfig,
        info: ModelInfo,
        tokenizer: Any,
        registry: WorkerRegistry,
        policy: DispatchPolicy,
    ) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.registry = registry
        self.policy = policy
        self.model_name = config.served_model_name or model_display_name(config.model)
        self.max_model_len = config.max_model_len or info.max_position
        self.text = RouterTokenizer(tokenizer, self.max_model_len)
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.links = {w.address: DecodeLink(w, self.router_id) for w in registry.by_role("decode")}
        self._background: set[asyncio.Task[Any]] = set()
        self._active_ids: set[str] = set()  # client request ids in flight
        self._submits = 0
        self.pacer = StreamPacer()

    def start(self) -> None:
        self.registry.start()
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        await self.registry.close()
        self.text.close()

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

    # -- inputs -------------------------------------------------------------------------------
    async def tokenize(self, text: str) -> list[int]:
        return await self.text.encode(text)

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await self.text.encode_chat(messages)

    def check_model(self, name: str) -> None:
        if name and name != self.model_name:
            raise ValueError(
                f"model {name!r} is not served here; this mesh serves {self.model_name!r}."
            )

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt must not be empty (it has 0 tokens).")
        vocab = self.info.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad}.")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the model's max length (max_model_len) is "
                f"{self.max_model_len}, which must leave room for at least one new token."
            )

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, inp: GenerationInput) -> AsyncIterator[Chunk]:
        """The request's chunks; the last has a finish reason. Raises ServiceError / ValueError.

        If its decode worker is lost mid-stream, the request moves to another one with the
        tokens already streamed appended to its prompt (`num_output_tokens_sent` tells the
        worker they count as output), so the client's stream goes on without a gap or a repeat.
        """
        self.check_prompt(inp.prompt)
        if inp.request_id in self._active_ids:
            raise ValueError(f"request_id {inp.request_id!r} is already in use by a request.")
        telemetry = RequestTelemetry(
            inp.request_id, len(inp.prompt), inp.params, self.config.policy
        )
        self._active_ids.add(inp.request_id)
        self.pacer.open += 1
        sent: list[int] = []  # every token streamed to the client so far
        lost: set[str] = set()  # decode workers lost during this request
        finished = False
        try:
            for failovers in itertools.count():
                attempt = await self._dispatch(inp, sent, lost, telemetry)
                try:
                    loop = asyncio.get_running_loop()
                    sent_at: float | None = None  # when the last message went out
                    while True:
                        if sent_at is not None:
                            # Under load, let tokens gather rather than send one message per step.
                            wait = sent_at + self.pacer.interval() - loop.time()
                            if wait > 0:
                                await asyncio.sleep(wait)
                        chunk, gone = _merge(inp.request_id, await attempt.queue.take_all())
                        if chunk.token_ids or chunk.finish_reason is not None:
                            attempt.first_tokens()
                            sent += chunk.token_ids
                            finished = attempt.finished = chunk.finish_reason is not None
                            yield chunk
                            if finished:
                                return
                            sent_at = loop.time()
                        if gone is not None:
                            break
                finally:
                    self._end(attempt)
                lost.add(gone.address)
                if failovers >= self.config.max_failovers:
                    raise ServiceError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"decode worker {gone.address} was lost mid-request ({gone.detail}), "
                        f"after {failovers} failovers.",
                    )
                telemetry.failover("worker_lost")
                log.warning(
                    "decode worker %s lost request %s after %d tokens (%s); moving it",
                    gone.address,
                    inp.request_id,
                    len(sent),
                    gone.detail,
                )
        finally:
            self._active_ids.discard(inp.request_id)
            telemetry.end(finished)
            self.pacer.open -= 1

    async def _dispatch(
        self,
        inp: GenerationInput,
        sent: list[int],
        lost: set[str],
        telemetry: RequestTelemetry,
    ) -> _Attempt:
        """Pick workers and submit; on to the next decode worker while one is unreachable or
        its queue is full. Raises ServiceError when none takes the request."""
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
                    raise ServiceError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "every decode worker's queue is full; retry later.",
                    )
                telemetry.no_worker()
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE, "no decode worker is available; retry later."
                )
            decision = self.policy.choose(prompt, decode, self.registry.healthy("prefill"))
            telemetry.dispatched(decision)
            self._submits += 1
            resumed = bool(sent) or bool(refused or unreachable)
            attempt = _Attempt.begin(
                self.links[decision.decode.address],
                decision,
                f"{inp.request_id}~{self._submits}" if resumed else inp.request_id,
                prompt.num_blocks,
            )
            request = worker_pb2.DecodeRequest(
                request_id=attempt.wire_id,
                subscriber_id=attempt.link.subscriber_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling_to_pb(inp.params),
                prefill_address=attempt.prefill.address if attempt.prefill is not None else "",
                disagg_min_tokens=self.config.disagg_min_tokens,
                deadline_unix_ms=int(inp.deadline * 1000) if inp.deadline else 0,
                arrival_unix_ns=time.time_ns(),
                num_output_tokens_sent=len(sent),
            )
            try:
                with telemetry.active():
                    await attempt.decode.stub.Submit(request, timeout=SUBMIT_TIMEOUT_S)  # type: ignore[attr-defined]
            except grpc.aio.AioRpcError as e:
                self._end(attempt)
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
                raise ServiceError(code, e.details() or "decode worker refused") from None
            attempt.decode.index.insert(prompt.block_hashes)
            if attempt.prefill is not None:
                attempt.prefill.index.insert(prompt.block_hashes)
            return attempt

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

    def _end(self, attempt: _Attempt) -> None:
        """Undo an attempt's bookkeeping; abort it on its worker unless it finished there."""
        attempt.link.unregister(attempt.wire_id)
        attempt.decode.inflight_blocks -= attempt.blocks
        attempt.first_tokens()
        if not attempt.finished:  # the client left, or the worker was lost or refused it
            self._spawn(self._abort(attempt.decode.stub, attempt.wire_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, stub: Any, request_id: str) -> None:
        try:
            await stub.Abort(worker_pb2.AbortRequest(request_ids=[request_id]), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.debug("abort of %s failed: %s", request_id, e.code())


# Submit errors after which another decode worker may take the request: the worker is
# unreachable, its engine failed or it is shutting down (CANCELLED: the router never cancels a
# Submit itself), or its token stream to this router is being reopened.
_RETRY_SUBMIT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


@dataclass(eq=False)
class _Attempt:
    """One submission of a request to a decode worker, and the load the router booked for it."""

    link: DecodeLink
    decode: Worker
    prefill: Worker | None
    wire_id: str  # the request's id on the decode worker
    queue: DeltaQueue
    blocks: int
    prefill_blocks: int
    finished: bool = False

    @classmethod
    def begin(cls, link: DecodeLink, decision: Decision, wire_id: str, blocks: int) -> _Attempt:
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


def _merge(request_id: str, items: list[Any]) -> tuple[Chunk, LinkLost | None]:
    """One chunk from a request's pending deltas, and the LinkLost marker if its worker's stream
    broke after them (this runs once per token: kept lean)."""
    token_ids: list[int] = []
    texts: list[str] = []
    chunk = Chunk(request_id, token_ids, "", None)
    lost = None
    for item in items:
        if item.__class__ is LinkLost:
            lost = item
            break
        token_ids += item.token_ids
        texts.append(item.text)
        if item.finish_reason or item.error_code:
            if item.error_code:
                status = _STATUS_BY_NUMBER.get(item.error_code, grpc.StatusCode.UNKNOWN)
                raise ServiceError(status, item.error_message or status.name)
            chunk.finish_reason = FINISH_FROM_PB[item.finish_reason]
            chunk.usage = item.usage
            chunk.timings = item.timings
            break
    chunk.text = "".join(texts)
    return chunk, lost
