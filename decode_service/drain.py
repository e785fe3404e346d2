"""Draining a decode worker: it stops admitting requests and hands each running one, with its
KV, to another decode worker (live migration, the sending side).

The protocol, for one request:

1. `Drainer.drain` (the Drain RPC, or SIGTERM with `--drain-on-sigterm`) marks the worker
   NOT_SERVING and refusing Submits, then on the engine thread detaches every movable request
   (engine/migration.py: the engine forgets it, its blocks stay held). Its tokens so far were
   published already, so the request's last delta here, `moved` with a fresh handle, follows
   them on its router's stream.
2. The router submits prompt + tokens sent to another decode worker with `migrate_from` (this
   worker's address and the handle). That worker reserves blocks and calls `Migrate`: the KV of
   every token but the last is pushed into its blocks over `kv_transfer`, then the blocks here
   are freed. Its replay of the tokens rebuilds the rest of the state (see engine/migration.py).
3. A request that cannot move with its KV (several choices, a tensor- or pipeline-parallel
   worker, no output yet, a remote prefill under way) is aborted here and marked `moved` with no
   handle: the router resubmits it as after a lost worker (recompute). A handle nobody pulls
   within `hold_s` (the router found no worker, the client left) is freed.

`drain` returns once no request is left here; the worker stays up, idle and NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from opentelemetry.trace import Span

from pdmesh.decode_service.migration_metrics import MigrationMetrics
from pdmesh.decode_service.types import Delta
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.migration import Detached, detach, drop
from pdmesh.errors import FailedPrecondition, InvalidRequest, NotFound, Unavailable
from pdmesh.kv_transfer.base import KVSender, SendHandle, TransferError, TransferStats
from pdmesh.kv_transfer.push_connector import start_sends
from pdmesh.kv_transfer.registry import check_transport, create_sender
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger
from pdmesh.observability import tracing

if TYPE_CHECKING:
    from pdmesh.decode_service.worker import DecodeWorker

log = get_logger(__name__)


@dataclass(frozen=True)
class DrainReport:
    migrated: int  # handed over with their KV
    recomputed: int  # moved without it


@dataclass
class _Outgoing:
    """A detached request waiting to be pulled."""

    detached: Detached
    expiry: asyncio.TimerHandle


class Drainer:
    """The sending side of live migration on one decode worker. Event loop only (engine work
    goes through the worker's `EngineLoop`). `hold_s`: how long a detached request waits to be
    pulled before its blocks are freed."""

    def __init__(self, worker: DecodeWorker, metrics: MigrationMetrics, hold_s: float) -> None:
        self.worker = worker
        self.metrics = metrics
        self.hold_s = hold_s
        self.draining = False
        self._out: dict[str, _Outgoing] = {}  # handle -> request waiting to be pulled
        self._pulling = 0  # Migrate calls under way
        self._senders: dict[str, KVSender] = {}  # by transport, made on first use
        self._drained: asyncio.Future[DrainReport] | None = None
        self._idle = asyncio.Event()
        self._migrated = 0
        self._recomputed = 0

    def check_admitting(self) -> None:
        """Unavailable while draining: the router submits to another decode worker."""
        if self.draining:
            raise Unavailable("this decode worker is draining; submit to another one.")

    async def drain(self) -> DrainReport:
        """Stop admitting and move every request away; returns once none is left here. A second
        call waits for the first one's result."""
        if self._drained is None:
            self._drained = asyncio.ensure_future(self._drain())
        return await asyncio.shield(self._drained)

    async def _drain(self) -> DrainReport:
        w = self.worker
        self.draining = True
        if w.health is not None:
            await w.health.set(False)
        return await self.evacuate()

    async def evacuate(self) -> DrainReport:
        """Move every request away, Submits refused meanwhile (`draining`); returns once none
        is left here, with what moved this time. `drain` is this with the worker NOT_SERVING
        for good; a worker that changes role (worker_service) evacuates and then admits again
        (`draining` False) in its new role."""
        w = self.worker
        self.draining = True
        self._idle.clear()
        before = (self._migrated, self._recomputed)
        start = time.monotonic()
        rids = list(w._owner)  # every request a router waits on here
        detached = await w.loop.acall(lambda e: self._detach(e, rids))
        stay = [rid for rid in rids if rid not in detached]
        for rid, d in detached.items():
            handle = secrets.token_hex(16)
            expiry = asyncio.get_running_loop().call_later(self.hold_s, self._expire, handle)
            self._out[handle] = _Outgoing(d, expiry)
            self._announce(rid, handle)
        # Requests that cannot move with their KV: ended here (their remote prefill cancelled
        # first), silently, since their router no longer listens for them; not those that
        # ended meanwhile (their last delta went out before this).
        told = [rid for rid in stay if self._announce(rid, "")]
        await w.abort(stay)
        for _ in told:
            self.metrics.count("out", "recomputed")
        self._recomputed += len(told)
        log.info(
            "draining: %d requests detached for migration, %d to be recomputed elsewhere",
            len(detached),
            len(told),
        )
        self._check_idle()
        await self._idle.wait()
        log.info("drained in %.3f s", time.monotonic() - start)
        return DrainReport(self._migrated - before[0], self._recomputed - before[1])

    def _detach(self, engine: LLMEngine, rids: list[str]) -> dict[str, Detached]:
        """Engine thread: take the movable requests out, with the worker's records of them."""
        out: dict[str, Detached] = {}
        for rid in rids:
            d = detach(engine, rid)
            if d is not None:
                out[rid] = d
                # Its records here end with it (a detached request publishes no last delta).
                self.worker._clocks.pop(rid, None)
                self.worker._deadlines.pop(rid, None)
        return out

    def _announce(self, rid: str, handle: str) -> bool:
        """The request's last delta here: after its tokens, on its router's stream. False when
        it has ended already."""
        w = self.worker
        subscriber = w._owner.pop(rid, None)
        if subscriber is None:
            return False
        queue = w._subscribers.get(subscriber)
        if queue is not None:
            queue.put_nowait([Delta(rid, [], "", None, moved=handle)])
        w.traces.moved(rid, handle)
        return True

    def _expire(self, handle: str) -> None:
        out = self._out.pop(handle, None)
        if out is None:
            return
        rid = out.detached.request_id
        log.warning("migrating request %s was not pulled in %.0f s", rid, self.hold_s)
        self.metrics.count("out", "expired")
        self._recomputed += 1
        self.worker.loop.call(lambda e: drop(e, out.detached))
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._out and not self._pulling:
            self._idle.set()

    # -- Migrate ----------------------------------------------------------------------------------
    async def migrate(self, handle: str, target: KVTarget | None, token_ids: list[int]) -> int:
        """Push a detached request's KV into `target` (None: the caller computes it; only forget
        it) and free its blocks here; the payload bytes pushed. NotFound for an unknown or
        expired handle, FailedPrecondition when `token_ids` are not the request's here,
        TransferError when the push failed."""
        out = self._out.pop(handle, None)
        if out is None:
            raise NotFound(f"no migrating request has handle {handle!r} (expired or taken).")
        out.expiry.cancel()
        self._pulling += 1
        # A task of its own: a caller that goes away (its deadline, a cancel) must not leave
        # the push's handles open or the blocks held; the push ends within its own timeout.
        task = asyncio.ensure_future(self._hand_over(out.detached, target, token_ids))
        task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    async def _hand_over(self, d: Detached, target: KVTarget | None, token_ids: list[int]) -> int:
        start = time.monotonic()
        span = _span(d, target)
        result, nbytes, error = "recomputed", 0, None
        try:
            if target is not None:
                self._check(d, target, token_ids)
                sender = self._sender(target.transport)
                handles = await self.worker.loop.acall(lambda e: self._push(sender, d, target))
                stats = await asyncio.to_thread(_finish, sender, handles, target.timeout_s)
                result, nbytes = "migrated", sum(s.bytes for s in stats)
            return nbytes
        except BaseException as exc:
            error = exc
            raise
        finally:
            # The pushed pages were copied out when queued: the blocks may go now.
            self.worker.loop.call(lambda e: drop(e, d))
            seconds = time.monotonic() - start
            self.metrics.count("out", result, nbytes, seconds if result == "migrated" else -1)
            if result == "migrated":
                self._migrated += 1
            else:
                self._recomputed += 1
            if span is not None:
                span.set_attribute("pdmesh.migration.result", result)
                span.set_attribute("pdmesh.kv.bytes", nbytes)
                tracing.end_span(span, error=error)
            self._pulling -= 1
            self._check_idle()

    def _check(self, d: Detached, target: KVTarget, token_ids: list[int]) -> None:
        if token_ids != d.token_ids:
            raise FailedPrecondition(
                f"token_ids ({len(token_ids)}) are not request {d.request_id}'s here "
                f"({len(d.token_ids)}); compute it instead."
            )
        g = self.worker.geometry
        if target.block_size != g.block_size:
            raise InvalidRequest(
                f"kv_target.block_size {target.block_size} is not this worker's {g.block_size}.",
                "kv_target.block_size",
            )
        have = -(-d.num_computed_tokens // g.block_size)
        end = target.first_block + target.num_blocks
        if end != have:
            raise InvalidRequest(
                f"kv_target names blocks {target.first_block}..{end} but the request's computed "
                f"tokens fill {have}.",
                "kv_target.block_ids",
            )

    def _sender(self, transport: str) -> KVSender:
        sender = self._senders.get(transport)
        if sender is None:
            check_transport(transport, self.worker.connector.binding.cache.device)
            sender = self._senders[transport] = create_sender(transport, self.worker.geometry)
        return sender

    def _push(self, sender: KVSender, d: Detached, target: KVTarget) -> list[SendHandle]:
        """Engine thread: queue every layer of the held blocks target names (copied out before
        this returns, so they may be freed after)."""
        binding = self.worker.connector.binding
        cache = binding.cache  # [L, 2, num_blocks, block_size, heads, head_dim]
        heads = binding.heads
        mine = range(heads.start, heads.start + heads.count)
        handles = start_sends(sender, target, mine, self.worker.geometry.layers)
        first = target.first_block
        ids = d.holder.block_table[first : first + target.num_blocks]
        try:
            block_ids = torch.tensor(ids, dtype=torch.int64, device=cache.device)
            sender.send_layers(handles, 0, cache, block_ids)
        except BaseException:
            for h in handles:
                sender.abort(h)
            raise
        return handles

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()


def _retrieve(task: asyncio.Task[int]) -> None:
    """A hand-over's outcome is reported by its caller, or not at all once the caller left."""
    if not task.cancelled():
        task.exception()


def _finish(sender: KVSender, handles: list[SendHandle], timeout_s: float) -> list[TransferStats]:
    """Wait for every frame's acknowledgement (a thread of its own)."""
    if not handles:
        raise TransferError("the target names no endpoint holding this worker's KV heads")
    return [sender.finish(h, timeout_s) for h in handles]


def _span(d: Detached, target: KVTarget | None) -> Span | None:
    """The hand-over's span, under the Migrate call's (the pulling worker's trace)."""
    if not tracing.enabled():
        return None
    return tracing.start_span(
        "decode.migrate_out",
        attributes={
            "pdmesh.request_id": d.request_id,
            "pdmesh.migration.tokens": len(d.token_ids),
            "pdmesh.kv.blocks": target.num_blocks if target is not None else 0,
        },
    )
