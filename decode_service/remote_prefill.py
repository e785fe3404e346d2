"""Prompts a prefill worker computes, the decode worker's side: one asyncio task per request,
from the Prefill call to the commit of its KV.

A request whose blocks `DecodeWorker._admit` reserved gets a task here (`start`). The task asks
the prefill worker named in the Submit to fill those blocks over the request's KV transport,
waits for the frames, and has the engine thread commit the prompt (its first tokens join the
batch). When the prefill or the transfer fails, the reservation is released and the prompt
computed here (`--prefill-failure-policy recompute`) or the request ends UNAVAILABLE (`fail`).
An abort or a deadline cancels the task (`cancel`); the reservation is then the abort's to
free. A migrating request's KV comes from a draining decode worker instead
(`Arrivals.pull`), under the same task bookkeeping.

Threads: tasks and `tasks` live on the worker's asyncio loop; `_commit` and `_failed` run on the
engine thread (through `EngineLoop.acall`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from pdmesh.decode_service.prefill_client import PrefillClient
from pdmesh.decode_service.types import Submission
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import FirstTokens
from pdmesh.errors import Unavailable
from pdmesh.kv_transfer.connector import ExternalBlocks
from pdmesh.kv_transfer.receive_connector import IncomingTransfer
from pdmesh.logger import get_logger
from pdmesh.observability import tracing

if TYPE_CHECKING:
    from pdmesh.decode_service.worker import DecodeWorker

log = get_logger(__name__)


class RemotePrefills:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.client = PrefillClient(worker.config.tls)
        self.tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its task

    def start(self, sub: Submission, plan: ExternalBlocks, span: object) -> None:
        """Asyncio loop: the task that fills `plan`'s blocks (the prefill call and the transfer
        join the request's trace, `span`)."""
        with tracing.use(span):
            task = asyncio.create_task(self._run(sub, plan))
        self.tasks[sub.request_id] = task

    def cancel(self, rid: str) -> None:
        """Asyncio loop: stop the request's task, if it has one (aborted, deadline passed)."""
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await self.client.close()

    async def _run(self, sub: Submission, plan: ExternalBlocks) -> None:
        w = self.worker
        if sub.migrate_from is not None:  # the KV comes from a draining decode worker
            return await w.arrivals.pull(sub, plan)
        rid = sub.request_id
        timeout = w.config.prefill_timeout_s
        if sub.deadline is not None:
            timeout = max(0.001, min(timeout, sub.deadline - time.time()))
        # The prefill worker replies only once its frames were acknowledged, so the transfer's own
        # clock must cover the queueing and compute on the prefill worker too.
        kv_timeout = w.config.kv_timeout_s
        rx_timeout = timeout + kv_timeout
        address = sub.prefill_address or ""
        transfer = w.kv.expect(w.kv.transport_for(address), plan.block_ids, rx_timeout)
        rx_span = w.traces.transfer_started(transfer.spec, w.geometry, transfer.transport)
        try:
            if w.kv.followers is not None:
                await w.loop.acall(lambda e: w.kv.expect_followers(transfer, rx_timeout))
            ctx = tracing.inject(rx_span) if rx_span is not None else {}
            target = w.kv.target(transfer, plan.first_block, timeout, ctx)
            first = await self.client.prefill(address, rid, sub.prompt, sub.params, target)
            moved = await asyncio.wait_for(asyncio.wrap_future(transfer.arrived), kv_timeout)
            if w.kv.followers is not None:
                await w.loop.acall(lambda e: w.kv.end_followers(transfer, kv_timeout))
        except BaseException as exc:
            self._cancel_transfer(transfer)
            w.traces.transfer_ended(rx_span, None, exc)
            if not isinstance(exc, Exception):  # cancelled: the request is gone
                raise
            log.warning("remote prefill of %s failed: %s", rid, exc)
            await w.loop.acall(lambda e, err=exc: self._failed(e, rid, err))
            return
        finally:
            self.tasks.pop(rid, None)
        w.traces.transfer_ended(rx_span, moved)
        w.metrics.transfer.observe(moved.seconds)
        try:
            await w.loop.acall(lambda e: self._commit(e, rid, first))
        except Exception as exc:  # a bug here: the request fails rather than wait forever
            log.exception("committing the remote prefill of %s failed", rid)
            message = f"committing the prefilled prompt failed: {exc}"
            await w.loop.acall(lambda e: w.end_with_error(e, rid, "INTERNAL", message))

    def _cancel_transfer(self, transfer: IncomingTransfer) -> None:
        w = self.worker
        w.kv.cancel(transfer)
        if w.kv.followers is not None:
            w.loop.call(lambda e: w.kv.end_followers(transfer, None))  # fire and forget

    # -- engine thread ----------------------------------------------------------------------------
    def _commit(self, engine: LLMEngine, rid: str, first: FirstTokens) -> None:
        w = self.worker
        deltas = w.kv.commit(engine, rid, first)
        if deltas is not None:  # else aborted meanwhile
            w.loop.publish(deltas)

    def _failed(self, engine: LLMEngine, rid: str, exc: BaseException) -> None:
        w = self.worker
        if w.config.prefill_failure_policy == "recompute":
            if w.kv.release(engine, rid):
                w.prefilled_here_after_all(rid)
        elif engine.is_reserved(rid):
            w.end_with_error(engine, rid, Unavailable.status, f"prefill failed: {exc}")
