"""The decode worker: admits requests, has them prefilled (by a prefill worker or here), decodes
them in one continuous batch and hands each step's tokens to its subscribers (routers).

Threads: the engine and everything it owns live on the engine thread (`EngineLoop`); the
asyncio loop owns subscribers, request ownership and the remote-prefill tasks
(`remote_prefill.py`). The two talk only through `EngineLoop.acall` / `publish` and
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from pdmesh.decode_service.config import DecodeConfig
from pdmesh.decode_service.drain import Drainer
from pdmesh.decode_service.early_aborts import EarlyAborts
from pdmesh.decode_service.metrics import DecodeMetrics
from pdmesh.decode_service.migration_in import Arrivals
from pdmesh.decode_service.migration_metrics import MigrationMetrics
from pdmesh.decode_service.remote_prefill import RemotePrefills
from pdmesh.decode_service.tracing import DecodeTraces
from pdmesh.decode_service.types import Delta, RequestClock, Submission, Timings, Usage
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    Overloaded,
)
from pdmesh.kv_transfer.connector import ExternalBlocks
from pdmesh.kv_transfer.receive_connector import ReceiveConnector
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.serving.store_link import Fetched
from pdmesh.serving.worker_process import WorkerProcess

log = get_logger(__name__)


class DecodeWorker(WorkerProcess):
    role = "decode"

    def __init__(
        self, config: DecodeConfig, connector: ReceiveConnector, engine: LLMEngine
    ) -> None:
        super().__init__(engine, connector, self._on_tick, config.kvstore, config.tls)
        self.config = config
        self.kv = connector  # receivers per tensor-parallel rank and transport
        self.prefills = {"local": 0, "remote": 0, "fallback": 0}  # prompts prefilled, by where
        # Engine thread only.
        self._deadlines: dict[str, float] = {}
        self._clocks: dict[str, RequestClock] = {}
        self._errors: dict[str, tuple[str, str]] = {}  # rid -> (status, message)
        # best_of > n: the n best are sent once every sequence has ended, nothing before.
        self._ranked: set[str] = set()
        # Each subscriber's queue; None ends its stream (the worker is stopping).
        self._subscribers: dict[str, asyncio.Queue[list[Delta] | None]] = {}
        self._owner: dict[str, str] = {}  # request id -> subscriber id
        self._early = EarlyAborts()
        # Engine thread: prompts prefilled here, to publish to the KV store once computed, with
        # how many of their leading blocks the store holds already.
        self._to_publish: dict[str, tuple[list[int], int]] = {}
        self.remote = RemotePrefills(self)  # the prompts prefill workers compute
        self.metrics = DecodeMetrics(self.metrics_snapshot)
        self.traces = DecodeTraces()
        # Live migration: handing running requests over when draining, continuing others'.
        migrations = MigrationMetrics()
        self.metrics.registry.register(migrations)
        self.drainer = Drainer(self, migrations, config.kv_timeout_s)
        self.arrivals = Arrivals(self, migrations)

    async def close(self) -> None:
        await self.remote.close()
        await super().close()
        await self.arrivals.close()
        self.drainer.close()

    async def report(self) -> dict[str, Any]:
        fields = await super().report()
        return {**fields, **self.drainer.metrics.stats_fields(), "draining": self.drainer.draining}

    def banner(self) -> str:
        planes = ", ".join(f"{name} at {a}" for name, a in self.kv.addresses.items())
        return f", KV data plane: {planes}"

    # -- subscribers (event loop) ---------------------------------------------------------------
    def subscribe(self, subscriber_id: str) -> asyncio.Queue[list[Delta] | None]:
        if not subscriber_id:
            raise InvalidRequest("subscriber_id must not be empty.", "subscriber_id")
        queue: asyncio.Queue[list[Delta] | None] = asyncio.Queue()
        self._subscribers[subscriber_id] = queue
        return queue

    async def before_server_stop(self) -> None:
        """End every Subscribe stream once the deltas queued for it are sent: the server's stop
        would otherwise hold them open for its grace period, then cancel them (the router
        sees either as this worker's stream lost)."""
        for queue in self._subscribers.values():
            queue.put_nowait(None)

    async def unsubscribe(
        self, subscriber_id: str, queue: asyncio.Queue[list[Delta] | None]
    ) -> None:
        """The subscriber's stream ended: nobody will read its requests' tokens, so end them."""
        if self._subscribers.get(subscriber_id) is not queue:
            return  # replaced by a newer stream of the same subscriber
        del self._subscribers[subscriber_id]
        orphans = [rid for rid, sub in self._owner.items() if sub == subscriber_id]
        if orphans:
            await self.abort(orphans)

    def _dispatch(self, deltas: list[Delta]) -> None:
        by_subscriber: dict[str, list[Delta]] = {}
        for d in deltas:
            if d.ends_request:
                self.traces.finished(d)
            sub = self._owner.get(d.request_id)
            if sub is None:
                continue
            by_subscriber.setdefault(sub, []).append(d)
            if d.ends_request:
                del self._owner[d.request_id]
        for sub, items in by_subscriber.items():
            queue = self._subscribers.get(sub)
            if queue is not None:
                queue.put_nowait(items)

    # -- requests (event loop) ------------------------------------------------------------------
    async def submit(self, sub: Submission) -> None:
        self.check_serving()
        self.drainer.check_admitting()
        if sub.subscriber_id not in self._subscribers:
            raise FailedPrecondition(
                f"subscriber {sub.subscriber_id!r} has no open Subscribe stream; subscribe first"
            )
        if sub.request_id in self._owner:
            raise InvalidRequest(f"request_id {sub.request_id!r} is already in use.", "request_id")
        rid = sub.request_id
        self._early.begin(rid)
        self._owner[rid] = sub.subscriber_id
        span = self.traces.begin(sub)
        try:
            if sub.params.structured_outputs is not None:  # compiled off the engine thread
                await asyncio.to_thread(self.engine.grammars.compile, sub.params.structured_outputs)
            fetched = None
            if self.store is not None and self._prefills_here(sub):
                with tracing.use(span):
                    fetched = await self.store.read_through(sub.prompt)
            if self._early.aborted(rid):
                # Aborted while compiling or fetching: admitting it now would run it for nobody.
                if fetched is not None:
                    await self.loop.acall(lambda e: self.store.settle(e, sub.prompt, fetched))
                raise Cancelled(f"request {rid!r} was aborted before it was admitted.")
            try:
                plan = await self.loop.acall(lambda e: self._admit(e, sub, fetched))
            except asyncio.CancelledError:
                # The Submit call went away while the engine thread admitted the request: end it
                # there (queued behind the admission), since no abort will name it now.
                self.loop.call(lambda e: self._abort_one(e, rid))
                raise
            if self._early.aborted(rid):
                # The abort queued behind the admission ends the request (and frees a
                # reservation): no prefill worker may fill blocks that are free again.
                raise Cancelled(f"request {rid!r} was aborted while it was admitted.")
        except BaseException as exc:
            self._owner.pop(rid, None)
            self.traces.refused(rid, exc)
            raise
        finally:
            self._early.end(rid)
        if plan is not None:
            self.remote.start(sub, plan, span)
            await asyncio.sleep(0)  # the Prefill call goes out before this reply: TTFT

    async def abort(self, request_ids: list[str]) -> int:
        for rid in request_ids:
            self._early.abort(rid, known=rid in self._owner)  # see submit
            self.remote.cancel(rid)
        return await self.loop.acall(lambda e: sum(self._abort_one(e, rid) for rid in request_ids))

    @staticmethod
    def _prefills_here(sub: Submission) -> bool:
        """Whether the prompt is computed here (no prefill worker, or a resumed request whose
        sampling state grew with its output: see `_admit`)."""
        if sub.migrate_from is not None:  # its KV comes from the worker it leaves
            return False
        return not sub.prefill_address or (
            sub.num_output_tokens_sent > 0 and sub.params.depends_on_output
        )

    # -- engine thread ----------------------------------------------------------------------------
    def _admit(
        self, engine: LLMEngine, sub: Submission, fetched: Fetched | None = None
    ) -> ExternalBlocks | None:
        # Fetched blocks join the prefix cache first, whatever happens to the request.
        known = self.store.settle(engine, sub.prompt, fetched) if self.store is not None else 0
        waiting = engine.num_waiting_for_blocks()
        if waiting >= self.config.max_waiting_requests:
            raise Overloaded(
                f"this decode worker's KV cache is full and {waiting} requests wait for it "
                f"(max_waiting_requests); retry later."
            )
        clock = RequestClock(
            arrival_ns=sub.arrival_ns or time.time_ns(), admitted_ns=time.time_ns()
        )
        plan = None
        sent = sub.num_output_tokens_sent
        # A resumed request whose sampling state grew with its output (a seed's stream, a
        # grammar's matcher, penalties) is prefilled here, where add_request replays that
        # output; a prefill worker would sample its next token as if nothing had been output.
        if sub.migrate_from is not None:
            plan = self.arrivals.reserve(engine, sub)
        elif not self._prefills_here(sub):
            plan = self.kv.reserve(
                engine, sub.request_id, sub.prompt, sub.params, sent, sub.disagg_min_tokens
            )
        if plan is None:
            engine.add_request(sub.request_id, sub.prompt, sub.params, num_output_tokens=sent)
            self.prefills["local"] += 1
            if self.store is not None:
                self._to_publish[sub.request_id] = (list(sub.prompt), known)
        elif sub.migrate_from is None:
            clock.disaggregated = True
            self.prefills["remote"] += 1
        self._clocks[sub.request_id] = clock
        if sub.params.ranks_sequences:
            self._ranked.add(sub.request_id)
        if sub.deadline is not None:
            self._deadlines[sub.request_id] = sub.deadline
        return plan

    def prefilled_here_after_all(self, rid: str) -> None:
        """The remote prefill failed and the prompt was queued to compute here (recompute)."""
        self.prefills["fallback"] += 1
        clock = self._clocks.get(rid)
        if clock is not None:  # its timings must say where it was prefilled in the end
            clock.disaggregated = False

    def end_with_error(self, engine: LLMEngine, rid: str, status: str, message: str) -> None:
        """End a request with a gRPC status (its name) and message on its last delta."""
        self._errors[rid] = (status, message)
        self._abort_one(engine, rid)

    def _abort_one(self, engine: LLMEngine, rid: str) -> int:
        delta = engine.abort_request(rid)
        if delta is None:
            return 0
        self.loop.publish([delta])
        return 1

    def _on_tick(self, engine: LLMEngine) -> None:
        deadlines = self._deadlines
        if not deadlines:
            return
        now = time.time()
        for rid in [r for r, d in deadlines.items() if now > d]:
            if self._aio is not None:
                self._aio.call_soon_threadsafe(self.remote.cancel, rid)
            message = "the request's deadline passed"
            self.end_with_error(engine, rid, DeadlineExceeded.status, message)
            deadlines.pop(rid, None)

    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        metrics = self.metrics
        out: list[Delta] = []
        now = time.time_ns()
        for d in deltas:
            rid = d.request_id
            clock = self._clocks.get(rid)
            if clock is not None and d.token_ids:
                if clock.first_token_ns:
                    metrics.next_tokens(now - clock.last_token_ns, len(d.token_ids))
                else:
                    clock.first_token_ns = now
                    metrics.first_token(now - clock.arrival_ns, len(d.token_ids))
                    self._publish(rid)
                clock.last_token_ns = now
            # A finish reason ends a choice (`index`); the request ends with its last choice.
            if not d.request_finished:
                if rid not in self._ranked:
                    out.append(
                        Delta(
                            rid,
                            d.token_ids,
                            d.text,
                            d.finish_reason,
                            logprobs=d.logprobs,
                            prompt_logprobs=d.prompt_logprobs,
                            index=d.index,
                        )
                    )
                continue
            out.extend(self._finished(d, now))
        if out and self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, out)

    def _publish(self, rid: str) -> None:
        """A prompt prefilled here has its first token: its blocks go to the KV store."""
        entry = self._to_publish.pop(rid, None)
        if entry is not None and self.store is not None:
            self.store.published(self.engine, *entry)

    def _finished(self, d: StepDelta, now: int) -> list[Delta]:
        """The last deltas of a request whose every choice has ended: its usage and timings on
        the last one. A ranked request (best_of > n) sends its n best choices whole here."""
        rid = d.request_id
        self._to_publish.pop(rid, None)
        result = self.engine.get_output(rid)
        self.engine.release(rid)
        self._deadlines.pop(rid, None)
        status, message = self._errors.pop(rid, ("", ""))
        field = ""
        if result.error is not None and not status:  # the engine ended it alone (its batch ran on)
            status, message = result.error.status, result.error.message
            field = result.error.field or ""
        clock = self._clocks.pop(rid, None) or RequestClock(now, now)
        first = clock.first_token_ns or now
        self.metrics.finish(
            d.finish_reason, clock.admitted_ns - clock.arrival_ns, now - clock.arrival_ns
        )
        usage = Usage(
            len(result.prompt_token_ids),
            sum(len(c.token_ids) for c in result.outputs),
            result.num_cached_tokens,
        )
        timings = Timings(
            queue_ns=clock.admitted_ns - clock.arrival_ns,
            prefill_ns=first - clock.admitted_ns,
            first_token_ns=first - clock.arrival_ns,
            decode_ns=now - first,
            total_ns=now - clock.arrival_ns,
            disaggregated=clock.disaggregated,
        )
        last = Delta(
            rid,
            d.token_ids,
            d.text,
            d.finish_reason,
            usage=usage,
            timings=timings,
            error_status=status,
            error_message=message,
            error_field=field,
            logprobs=d.logprobs,
            prompt_logprobs=d.prompt_logprobs,
            index=d.index,
        )
        if rid not in self._ranked:
            return [last]
        self._ranked.discard(rid)
        if d.finish_reason == "abort" or status:
            return [dataclasses.replace(last, token_ids=[], text="", logprobs=None)]
        whole = [
            Delta(
                rid,
                c.token_ids,
                c.text,
                c.finish_reason,
                logprobs=c.logprobs,
                prompt_logprobs=result.prompt_logprobs if c.index == 0 else None,
                index=c.index,
            )
            for c in result.outputs
        ]
        whole[-1] = dataclasses.replace(
            whole[-1],
            usage=usage,
            timings=timings,
            error_status=status,
            error_message=message,
            error_field=field,
        )
        return whole
