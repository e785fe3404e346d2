"""Continuing a request another decode worker hands over (live migration, the receiving side;
the sending side and the protocol: drain.py).

A Submit with `migrate_from` carries prompt + the tokens the client has (the last of them is the
next input). This worker reserves blocks for all tokens but the last, as for a prompt a prefill
worker computes, and calls the draining worker's `Migrate`, which pushes their KV into them.
Committing then appends the last token as if a prefill had sampled it: the engine's replay of
the tokens rebuilds the detokenizer's held-back text, a grammar's matcher, penalty counts and a
seed's position (one draw per output token: rebuilt from the seed here, so a step the other
worker launched ahead and dropped does not shift it), and the delta of that token, sent by the
other worker already, is not sent again. Whatever fails on the way (no blocks here, the push, a
timeout), the reservation is given up and the request computed here from its tokens, as after a
lost worker: never a token lost or sent twice, never a block left held on either side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import grpc
from opentelemetry.trace import Span

from pdmesh.decode_service.migration_metrics import MigrationMetrics
from pdmesh.decode_service.types import Delta, Submission, Usage
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import FirstTokens
from pdmesh.kv_transfer.connector import ExternalBlocks
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.serving.grpc_server import channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from pdmesh.decode_service.worker import DecodeWorker

log = get_logger(__name__)


class MigrationClient:
    """Calls to draining decode workers' `Migrate`."""

    def __init__(self, tls: TLSConfig | None = None) -> None:
        self._tls = tls
        self._stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = channel(address, self._tls)
            self._channels.append(ch)
            stub = self._stubs[address] = worker_pb2_grpc.DecodeWorkerStub(ch)
        return stub

    async def migrate(
        self,
        address: str,
        handle: str,
        target: KVTarget | None,
        token_ids: list[int],
        timeout_s: float,
    ) -> int:
        """Have the worker at `address` push the request's KV into `target` (None: only forget
        it there); the payload bytes it pushed. Raises grpc.aio.AioRpcError."""
        request = worker_pb2.MigrateRequest(handle=handle, token_ids=token_ids)
        if target is not None:
            request.kv_target.CopyFrom(target.to_pb())
        reply = await self._stub(address).Migrate(request, timeout=timeout_s)
        return reply.kv_bytes

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


class Arrivals:
    """The receiving side of live migration on one decode worker: `reserve` on the engine
    thread (from the worker's admission), `pull` as the request's task on the event loop."""

    def __init__(self, worker: DecodeWorker, metrics: MigrationMetrics) -> None:
        self.worker = worker
        self.metrics = metrics
        self.client = MigrationClient(worker.config.tls)
        self._background: set[asyncio.Task[None]] = set()

    def reserve(self, engine: LLMEngine, sub: Submission) -> ExternalBlocks | None:
        """Engine thread: blocks for the KV of every token but the last, or None: the caller
        computes the request here (the draining worker is told to let it go)."""
        sent = sub.num_output_tokens_sent
        plan = None
        if sent >= 1 and sub.params.num_sequences == 1 and engine.config.world_size == 1:
            plan = self.worker.kv.reserve(
                engine, sub.request_id, sub.prompt[:-1], sub.params, sent - 1, 1
            )
        if plan is None:
            aio = self.worker._aio
            if aio is not None:
                aio.call_soon_threadsafe(self._let_go, sub)
        return plan

    def _let_go(self, sub: Submission) -> None:
        self.metrics.count("in", "recomputed")
        task = asyncio.create_task(self._forget_there(sub))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _forget_there(self, sub: Submission) -> None:
        source = sub.migrate_from
        assert source is not None
        try:
            await self.client.migrate(source.address, source.handle, None, [], 10.0)
        except grpc.aio.AioRpcError as e:  # it frees the blocks when the handle expires
            log.debug("letting %s go at %s failed: %s", sub.request_id, source.address, e.code())

    async def pull(self, sub: Submission, plan: ExternalBlocks) -> None:
        """The request's task: pull its KV into the reserved blocks and commit, or compute it
        here when that fails. Cancelled: the request was aborted (the reservation is the
        abort's to free)."""
        w, rid, source = self.worker, sub.request_id, sub.migrate_from
        assert source is not None
        start = time.monotonic()
        timeout = w.config.kv_timeout_s
        transfer = w.kv.expect(w.kv.transport_for(source.address), plan.block_ids, timeout)
        rx_span = w.traces.transfer_started(transfer.spec, w.geometry, transfer.transport)
        span = _span(sub, plan)
        try:
            ctx = tracing.inject(rx_span) if rx_span is not None else {}
            target = w.kv.target(transfer, plan.first_block, timeout, ctx)
            with tracing.use(span):
                await self.client.migrate(
                    source.address, source.handle, target, sub.prompt, timeout
                )
            moved = await asyncio.wait_for(asyncio.wrap_future(transfer.arrived), timeout)
        except BaseException as exc:
            w.kv.cancel(transfer)  # no frame of it is written from here on
            w.traces.transfer_ended(rx_span, None, exc)
            _end(span, "recomputed", 0, exc)
            if not isinstance(exc, Exception):
                raise
            log.warning("migrating %s from %s failed (%s); computing it here", rid, source, exc)
            self.metrics.count("in", "recomputed")
            try:
                await w.loop.acall(lambda e: self._recompute(e, sub))
            except Exception as err:  # a bug: the request fails rather than wait forever
                log.exception("computing migrated request %s here failed", rid)
                w._dispatch([_failed(sub, f"continuing the migrated request failed: {err}")])
            return
        finally:
            w.remote.tasks.pop(rid, None)
        w.traces.transfer_ended(rx_span, moved)
        await w.loop.acall(lambda e: self._commit(e, sub))
        self.metrics.count("in", "migrated", moved.bytes, time.monotonic() - start)
        _end(span, "migrated", moved.bytes)

    def _commit(self, engine: LLMEngine, sub: Submission) -> None:
        """Engine thread: the KV is in; the last token was sampled and sent by the other worker."""
        rid = sub.request_id
        deltas = self.worker.kv.commit(engine, rid, FirstTokens([sub.prompt[-1]]))
        if deltas is None:  # aborted meanwhile
            return
        clock = self.worker._clocks.get(rid)
        if clock is not None:  # its next tokens are inter-token gaps, not a first token
            clock.first_token_ns = clock.last_token_ns = time.time_ns()
        # Only an end can be news here (another limit on this worker): without the token.
        ends = [
            dataclasses.replace(d, token_ids=[], logprobs=None) for d in deltas if d.finish_reason
        ]
        if ends:
            self.worker.loop.publish(ends)

    def _recompute(self, engine: LLMEngine, sub: Submission) -> None:
        """Engine thread: give up the reservation and compute the request here from its tokens
        (prompt + output so far, as after a lost worker)."""
        rid = sub.request_id
        if not engine.is_reserved(rid):
            return  # aborted meanwhile
        engine.abort_request(rid)  # frees the reserved blocks; not published
        engine.release(rid)
        engine.add_request(
            rid, sub.prompt, sub.params, num_output_tokens=sub.num_output_tokens_sent
        )

    async def close(self) -> None:
        await self.client.close()


def _failed(sub: Submission, message: str) -> Delta:
    """The last delta of a request that could not be continued here."""
    sent = sub.num_output_tokens_sent
    usage = Usage(len(sub.prompt) - sent, sent, 0)
    return Delta(
        sub.request_id, [], "", "abort", usage, error_status="INTERNAL", error_message=message
    )


def _span(sub: Submission, plan: ExternalBlocks) -> Span | None:
    """The hand-over's span, in the request's trace (the task runs in its span's context)."""
    if not tracing.enabled():
        return None
    source = sub.migrate_from
    return tracing.start_span(
        "decode.migrate_in",
        attributes={
            "pdmesh.request_id": sub.request_id,
            "pdmesh.migration.source": source.address if source is not None else "",
            "pdmesh.migration.tokens": len(sub.prompt),
            "pdmesh.kv.blocks": len(plan.block_ids),
        },
    )


def _end(span: Span | None, result: str, nbytes: int, error: BaseException | None = None) -> None:
    if span is None:
        return
    span.set_attribute("pdmesh.migration.result", result)
    span.set_attribute("pdmesh.kv.bytes", nbytes)
    tracing.end_span(span, error=error)
