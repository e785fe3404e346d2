"""The router: tokenizes once, picks the workers, submits to the decode worker and relays its
tokens. Shared by the gRPC API and the HTTP gateway."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdmesh.engine.llm import chat_token_ids
from pdmesh.engine.model_info import ModelInfo
from pdmesh.engine.model_source import model_display_name
from pdmesh.engine.prefix_hash import hash_prefix_blocks
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.logger import get_logger
from pdmesh.router.config import RouterConfig
from pdmesh.router.decode_link import DecodeLink, LinkLost
from pdmesh.router.policies import DispatchPolicy, PromptInfo
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.router.request_telemetry import RequestTelemetry
from pdmesh.router.stream_pacing import StreamPacer
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
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.links = {w.address: DecodeLink(w, self.router_id) for w in registry.by_role("decode")}
        self._background: set[asyncio.Task[Any]] = set()
        self.pacer = StreamPacer()

    def start(self) -> None:
        self.registry.start()
        for link in self.links.values():
            link.start()

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        await self.registry.close()

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
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

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
        """The request's chunks; the last has a finish reason. Raises ServiceError / ValueError."""
        self.check_prompt(inp.prompt)
        telemetry = RequestTelemetry(
            inp.request_id, len(inp.prompt), inp.params, self.config.policy
        )
        decode = await self.ready_decode_workers(wait_s=LINK_WAIT_S)
        if not decode:
            telemetry.no_worker()
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "no decode worker is available; retry later."
            )
        bs = self.block_size
        prompt = PromptInfo(len(inp.prompt), hash_prefix_blocks(inp.prompt, bs), bs)
        decision = self.policy.choose(prompt, decode, self.registry.healthy("prefill"))
        telemetry.dispatched(decision)
        d, p = decision.decode, decision.prefill
        link = self.links[d.address]
        queue = link.register(inp.request_id)
        d.inflight_blocks += prompt.num_blocks
        if p is not None:
            p.inflight_blocks += decision.prefill_miss_blocks
        prefill_pending = p is not None
        finished = False
        self.pacer.open += 1
        try:
            request = worker_pb2.DecodeRequest(
                request_id=inp.request_id,
                subscriber_id=link.subscriber_id,
                prompt_token_ids=inp.prompt,
                sampling=sampling_to_pb(inp.params),
                prefill_address=p.address if p is not None else "",
                disagg_min_tokens=self.config.disagg_min_tokens,
                deadline_unix_ms=int(inp.deadline * 1000) if inp.deadline else 0,
                arrival_unix_ns=time.time_ns(),
            )
            try:
                with telemetry.active():
                    await d.stub.Submit(request, timeout=SUBMIT_TIMEOUT_S)  # type: ignore[attr-defined]
            except grpc.aio.AioRpcError as e:
                raise ServiceError(e.code(), e.details() or "decode worker refused") from None
            d.index.insert(prompt.block_hashes)
            if p is not None:
                p.index.insert(prompt.block_hashes)
            loop = asyncio.get_running_loop()
            sent_at: float | None = None  # when the last message went out
            while True:
                if sent_at is not None:
                    # Under load, let tokens gather rather than send one message per step.
                    wait = sent_at + self.pacer.interval() - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                chunk = _merge(inp.request_id, await queue.take_all())
                if prefill_pending and chunk.token_ids and p is not None:
                    p.inflight_blocks -= decision.prefill_miss_blocks
                    prefill_pending = False
                if chunk.finish_reason is not None:
                    finished = True
                yield chunk
                if finished:
                    return
                sent_at = loop.time()
        finally:
            telemetry.end(finished)
            self.pacer.open -= 1
            link.unregister(inp.request_id)
            d.inflight_blocks -= prompt.num_blocks
            if prefill_pending and p is not None:
                p.inflight_blocks -= decision.prefill_miss_blocks
            if not finished:  # the client left, or the link broke: free the worker's blocks
                self._spawn(self._abort(d.stub, inp.request_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, stub: Any, request_id: str) -> None:
        try:
            await stub.Abort(worker_pb2.AbortRequest(request_ids=[request_id]), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.debug("abort of %s failed: %s", request_id, e.code())


def _merge(request_id: str, items: list[Any]) -> Chunk:
    """One chunk from a request's pending deltas (this runs once per token: kept lean)."""
    token_ids: list[int] = []
    texts: list[str] = []
    chunk = Chunk(request_id, token_ids, "", None)
    for item in items:
        if item.__class__ is LinkLost:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {item.address} was lost mid-request ({item.detail}).",
            )
        token_ids += item.token_ids
        texts.append(item.text)
        if item.finish_reason or item.error_code:
            if item.error_code:
                status = _STATUS_BY_NUMBER.get(item.error_code, grpc.StatusCode.UNKNOWN)
                raise ServiceError(status, item.error_message or status.name)
            chunk.finish_reason = FINISH_FROM_PB[item.finish_reason]
            chunk.usage = item.usage
            chunk.timings = item.timings
    chunk.text = "".join(texts)
    return chunk
