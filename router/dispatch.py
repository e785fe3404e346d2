"""Submitting a request to a decode worker and relaying its tokens.

`Dispatcher.submit` picks the workers (the dispatch policy), books their load, sends `Submit`,
and moves on to another decode worker while one is unreachable or its queue is full. One
submission is an `Attempt`: `Attempt.relay` streams its tokens, paced; `Dispatcher.end` undoes
its booking (and aborts it on its worker unless it finished there).

This is the router's gRPC client edge toward decode workers: their status codes become
`pdmesh.errors` here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdmesh.errors import (
    FIELD_METADATA,
    Overloaded,
    Unavailable,
    from_status,
    without_source_locations,
)
from pdmesh.logger import get_logger
from pdmesh.prefix_hash import hash_prefix_blocks
from pdmesh.router import metrics
from pdmesh.router.config import RouterConfig
from pdmesh.router.decode_link import DecodeLink, DeltaQueue, LinkLost
from pdmesh.router.policies import Decision, LocalTargets, PromptInfo, create_policy
from pdmesh.router.prefill_rate import PrefillRate
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.router.request_telemetry import RequestTelemetry
from pdmesh.router.store_hits import StoreHits
from pdmesh.router.stream_pacing import StreamPacer
from pdmesh.serving.convert import sampling_to_pb
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import worker_pb2
from pdmesh.validation import ValidRequest

log = get_logger(__name__)

# A decode worker admits a request within its structured-output constraint's compile limit
# (10 s, after up to 1 s waiting for a compile slot): a Submit may take past that, or the router
# would answer DEADLINE_EXCEEDED for a request the worker was about to refuse or admit.
SUBMIT_TIMEOUT_S = 20.0
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
# A decode worker reports a failed request's status as its gRPC code's number.
_STATUS_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


@dataclass(frozen=True)
class PrefillTiming:
    """A fresh request's prefill, timed from its Submit to its first token (PrefillRate)."""

    rate: PrefillRate
    remote: bool
    tokens: int  # computed before its first token: its prefill worker's queue and its own
    start: float = field(default_factory=time.monotonic)

    def first_token(self) -> None:
        self.rate.observe(self.remote, time.monotonic() - self.start, self.tokens)


@dataclass(eq=False)
class Attempt:
    """One submission of a request to a decode worker, and the load the router booked for it
    (booked when made). `finished`: its last chunk was relayed; `lost`: its worker's stream
    broke first; `moved`: its worker handed it over (it drains; see router/migration.py)."""

    request_id: str  # the client's
    wire_id: str  # the request's id on the decode worker
    link: DecodeLink
    decode: Worker
    prefill: Worker | None
    blocks: int
    prefill_blocks: int
    queue: DeltaQueue = field(init=False)
    finished: bool = False
    lost: LinkLost | None = None
    moved: str | None = None  # the worker's migration handle ("": nothing to pull)
    timing: PrefillTiming | None = None
    local_blocks: int = 0  # uncached blocks its decode worker prefills itself

    def __post_init__(self) -> None:
        self.queue = self.link.register(self.wire_id)
        self.decode.inflight_blocks += self.blocks
        self.decode.streams += 1
        metrics.worker_streams(self.decode.address, self.decode.streams)
        self.decode.local_prefill_blocks += self.local_blocks
        if self.prefill is not None:
            self.prefill.inflight_blocks += self.prefill_blocks

    def first_tokens(self) -> None:
        """The prefill is over (tokens came, or the attempt ended): release its booking."""
        if self.prefill is not None:
            self.prefill.inflight_blocks -= self.prefill_blocks
            self.prefill = None
        self.decode.local_prefill_blocks -= self.local_blocks
        self.local_blocks = 0

    async def relay(self, pacer: StreamPacer) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Chunks of whatever piled up on the queue since the last one (under load it first
        waits out the pacer's interval, so tokens gather rather than go one message per step;
        see stream_pacing.py). Ends after the chunk with the finish reason (`finished`), or when
        the worker's stream broke (`lost`) or the worker handed the request over (`moved`,
        after every token it sent); a request that failed on its worker raises the
        `pdmesh.errors` class of the worker's status. This is the router's per-token path."""
        loop = asyncio.get_running_loop()
        sent_at: float | None = None  # when the last message went out
        while True:
            if sent_at is not None and (wait := sent_at + pacer.interval() - loop.time()) > 0:
                await asyncio.sleep(wait)
            chunks, lost, moved = _merge(self.request_id, await self.queue.take_all())
            for chunk in chunks:
                if self.timing is not None:
                    self.timing.first_token()
                    self.timing = None
                self.first_tokens()
                self.finished = chunk.HasField("usage")  # the request's last chunk
                yield chunk
                if self.finished:
                    return
            if chunks:
                sent_at = loop.time()
            if lost is not None:
                self.lost = lost
                return
            if moved is not None:
                self.moved = moved
                return


def _merge(
    request_id: str, items: list[Any]
) -> tuple[list[gen_pb.GenerateResponse], LinkLost | None, str | None]:
    """Chunks of a request's pending deltas, one per run of deltas of the same choice (one
    chunk when n is 1), usage and timings on the request's last; and the LinkLost marker if its
    worker's stream broke after them, or the migration handle if its worker handed it over.

    This runs for every message a client is sent. Most of the time `items` is one delta with
    tokens and text, and no logprobs: its chunk is built in one constructor call, and the
    fields a delta lacks are not touched (extending a repeated field, even by nothing, costs a
    wrapper object per field and delta)."""
    chunks: list[gen_pb.GenerateResponse] = []
    chunk: gen_pb.GenerateResponse | None = None
    texts: list[str] | None = None  # `chunk`'s texts once a second delta joins it
    lost = moved = None
    for item in items:
        if item.__class__ is LinkLost:
            lost = item
            break
        if item.HasField("moved"):
            moved = item.moved.handle
            break
        if item.error_code:
            status = _STATUS_NAMES.get(item.error_code, "UNKNOWN")
            raise from_status(status, item.error_message or status, item.error_field or None)
        token_ids, reason = item.token_ids, item.finish_reason
        if not (token_ids or reason):
            continue
        if chunk is None or chunk.index != item.index or chunk.finish_reason:
            if chunk is not None and texts is not None:
                chunk.text = "".join(texts)
                texts = None
            chunk = gen_pb.GenerateResponse(
                request_id=request_id, index=item.index, token_ids=token_ids, text=item.text
            )
            chunks.append(chunk)
        else:
            chunk.token_ids.extend(token_ids)
            if texts is None:
                texts = [chunk.text]
            texts.append(item.text)
        if item.logprobs:
            chunk.logprobs.extend(item.logprobs)
        if item.prompt_logprobs:
            chunk.prompt_logprobs.extend(item.prompt_logprobs)
        if reason:  # the choice's end; usage and timings: the request's
            chunk.finish_reason = reason
            if item.HasField("usage"):
                chunk.usage.CopyFrom(item.usage)
                chunk.timings.CopyFrom(item.timings)
                break
    if chunk is not None and texts is not None:
        chunk.text = "".join(texts)
    return chunks, lost, moved


class Dispatcher:
    """Decode links, worker choice (the configured policy) and submission for one router."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        # Measured always (the planner reads it); dispatch uses it with --load-aware-disagg.
        self.prefill_rate = PrefillRate()
        self.policy = create_policy(
            config.policy,
            config.overlap_weight,
            config.disagg_min_tokens,
            self.prefill_rate if config.load_aware_disagg else None,
            LocalTargets(config.slo_ttft_s, config.slo_itl_p99_s),
        )
        self.store = StoreHits(config.kvstore, config.tls) if config.kvstore else None
        self._router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.links: dict[str, DecodeLink] = {}
        self._started = False
        for w in registry.by_role("decode"):
            self.link(w)
        self._background: set[asyncio.Task[Any]] = set()
        self._submits = 0

    def start(self) -> None:
        self._started = True
        for link in self.links.values():
            link.start()

    def link(self, worker: Worker) -> DecodeLink:
        """The decode worker's token stream to this router, opened on first need (for a worker
        that became a decode worker: router/roles.py)."""
        link = self.links.get(worker.address)
        if link is None:
            link = self.links[worker.address] = DecodeLink(worker, self._router_id)
            if self._started:
                link.start()
        return link

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        if self.store is not None:
            await self.store.close()

    def decode_ready(self) -> list[Worker]:
        """Decode workers in rotation whose token stream to this router is open."""
        healthy = self.registry.healthy("decode")
        return [w for w in healthy if self.link(w).connected.is_set()]

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
        migrate_from: worker_pb2.MigrateFrom | None = None,
    ) -> Attempt:
        """Submit `inp` with the tokens already `sent` to the client appended to its prompt
        (they count as output), avoiding the decode workers in `lost`; `migrate_from`: the
        chosen worker pulls its KV from a draining one. Overloaded when every decode worker
        refuses it for now (its queue is full, or its constraint finds no compile slot),
        Unavailable when none is there to take it."""
        prompt_ids = inp.prompt + sent if sent else inp.prompt
        params = inp.params
        if sent and params.prompt_logprobs is not None:  # sent with the first token already
            params = dataclasses.replace(params, prompt_logprobs=None)
        bs = self.block_size
        held = await self.store.blocks(prompt_ids) if self.store is not None else 0
        prompt = PromptInfo(len(prompt_ids), hash_prefix_blocks(prompt_ids, bs), bs, held)
        refused: set[str] = set()  # queue full, or no room for its constraint to compile
        refusal = ""  # the last worker's reason
        unreachable: set[str] = set()
        failures = 0  # Submits that failed for want of a worker (a worker may fail twice)
        while True:
            decode = await self._candidates(lost | unreachable, refused)
            if not decode:
                if refused:
                    raise Overloaded(
                        f"every decode worker refused the request for now; the last said: {refusal}"
                    )
                telemetry.no_worker()
                raise Unavailable("no decode worker is available; retry later.")
            decision = self.policy.choose(prompt, decode, self.registry.healthy("prefill"))
            telemetry.dispatched(decision)
            self._submits += 1
            resumed = bool(sent) or bool(refused or unreachable)
            d = decision.decode
            prefill = decision.prefill if migrate_from is None else None  # the KV exists
            # The fallback too: the decode worker checks its own cache first.
            prefill_to = (prefill or decision.fallback) if migrate_from is None else None
            fresh = not resumed and migrate_from is None
            timing = self._timing(prompt, decision) if fresh and prefill_to is prefill else None
            local = prefill is None and migrate_from is None
            local_blocks = -(-prompt.uncached_tokens(d) // prompt.block_size) if local else 0
            attempt = Attempt(
                inp.request_id,
                f"{inp.request_id}~{self._submits}" if resumed else inp.request_id,
                self.link(d),
                d,
                prefill,
                prompt.num_blocks,
                decision.prefill_miss_blocks,
                timing=timing,
                local_blocks=local_blocks,
            )
            request = worker_pb2.DecodeRequest(
                request_id=attempt.wire_id,
                subscriber_id=attempt.link.subscriber_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling_to_pb(params),
                prefill_address=prefill_to.address if prefill_to is not None else "",
                disagg_min_tokens=self.config.disagg_min_tokens,
                deadline_unix_ms=int(inp.deadline * 1000) if inp.deadline else 0,
                arrival_unix_ns=time.time_ns(),
                num_output_tokens_sent=len(sent),
                migrate_from=migrate_from,
            )
            try:
                with telemetry.active():
                    await attempt.link.stub.Submit(request, timeout=SUBMIT_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                self.end(attempt)
                code = e.code()
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.add(d.address)
                    refusal = without_source_locations(e.details() or "retry later.")
                    telemetry.failover("queue_full")
                    continue
                if code in _RETRY_SUBMIT and failures < self.config.max_failovers:
                    failures += 1
                    unreachable.add(d.address)
                    telemetry.failover("submit_failed")
                    continue
                field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA)
                detail = e.details() or "decode worker refused"
                raise from_status(code.name, detail, field) from None
            d.index.insert(prompt.block_hashes)
            if prefill is not None:
                prefill.index.insert(prompt.block_hashes)
            return attempt

    def _timing(self, prompt: PromptInfo, decision: Decision) -> PrefillTiming:
        """What a fresh request's prefill will compute, to time it: on a prefill worker, the
        tokens booked there before it and its own; on its decode worker, the tokens of the
        prompts this router gave it to prefill before and its own uncached ones."""
        if decision.prefill is not None:
            blocks = decision.prefill.inflight_blocks + decision.prefill_miss_blocks
            return PrefillTiming(self.prefill_rate, True, blocks * prompt.block_size)
        return PrefillTiming(self.prefill_rate, False, prompt.local_tokens(decision.decode))

    async def _candidates(self, avoid: set[str], refused: set[str]) -> list[Worker]:
        """Ready decode workers not in `refused`: waits up to LINK_WAIT_S for any to be ready
        (a link reconnecting), then up to LINK_WAIT_S more for one not in `avoid`; one in
        `avoid` serves again if it is the only one back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINK_WAIT_S
        while not (ready := self.decode_ready()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        deadline = loop.time() + LINK_WAIT_S
        while True:
            ready = [w for w in ready if w.address not in refused]
            fresh = [w for w in ready if w.address not in avoid]
            if fresh or not avoid or loop.time() >= deadline:
                return fresh or ready
            await asyncio.sleep(0.05)
            ready = self.decode_ready()

    def end(self, attempt: Attempt) -> None:
        """Undo an attempt's bookkeeping; abort it on its worker unless it finished there."""
        attempt.link.unregister(attempt.wire_id)
        attempt.decode.inflight_blocks -= attempt.blocks
        attempt.decode.streams -= 1
        metrics.worker_streams(attempt.decode.address, attempt.decode.streams)
        attempt.first_tokens()
        # Not when the client left, or the worker was lost or refused it; a request its worker
        # handed over has ended there (an Abort now could free KV another worker pulls).
        if not attempt.finished and attempt.moved is None:
            task = asyncio.get_running_loop().create_task(
                _abort(attempt.link.stub, attempt.wire_id)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)


async def _abort(stub: Any, request_id: str) -> None:
    try:
        await stub.Abort(worker_pb2.AbortRequest(request_ids=[request_id]), timeout=5)
    except grpc.aio.AioRpcError as e:
        log.debug("abort of %s failed: %s", request_id, e.code())
