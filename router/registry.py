"""The workers the router knows, with grpc.health.v1 checks and load from their stats RPC.

A worker enters the rotation when its health check says SERVING and leaves it when a check
fails or says otherwise; checks keep running, so it comes back when healthy again. Each exit
from the rotation is counted, and so is each restart: a worker's stats carry its process's
start time, and a new one is a new process (router/metrics.py).

A worker's role is the one of the router's list it is in, until the worker says otherwise: a
worker that takes either role (`pdmesh worker`) reports the one it serves in its stats, and the
registry follows it (router/roles.py switches one; a restarted router finds the roles again).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health_pb2_grpc import HealthStub

from pdmesh.logger import get_logger
from pdmesh.router import metrics
from pdmesh.router.config import RouterConfig
from pdmesh.router.prefix_index import PrefixIndex
from pdmesh.serving.grpc_server import channel
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)


@dataclass(eq=False)
class Worker:
    address: str
    role: str  # "prefill" or "decode"
    healthy: bool = False
    load: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)  # last stats
    # Blocks this router sent the worker that its last stats may not show yet.
    inflight_blocks: int = 0
    # This router's requests on the decode worker now, known at once (its stats lag by up to
    # the stats interval; at 8 prompts a second that is four arrivals).
    streams: int = 0
    # Blocks of prompts this router gave the decode worker to prefill itself, first token not
    # yet back: its own prefill queue (load-aware disaggregation, router/policies/base.py).
    local_prefill_blocks: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    channel: grpc.aio.Channel | None = None
    stub: object = None
    health_stub: HealthStub | None = None
    # Changing role (router/roles.py): in no role's rotation until it serves the new one.
    switching: bool = False
    # Counts switches begun and ended: stats asked for before one say nothing of the role.
    role_epoch: int = 0

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles it can take, as its last stats say (before any: its own)."""
        return tuple(self.load.roles) or (self.role,)

    def take_role(self, role: str) -> None:
        """Serve `role` from now on: its stub becomes that role's."""
        if role == self.role:
            return
        metrics.worker_role(self.address, self.role, role, self.healthy)
        log.info("worker %s now serves %s (was %s)", self.address, role, self.role)
        self.role = role
        assert self.channel is not None
        self.stub = _STUBS[role](self.channel)

    @property
    def kv_usage(self) -> float:
        total = self.load.kv_blocks_total or 1
        return (self.load.kv_blocks_used + self.inflight_blocks) / total


_STUBS = {
    "prefill": worker_pb2_grpc.PrefillWorkerStub,
    "decode": worker_pb2_grpc.DecodeWorkerStub,
}


class WorkerRegistry:
    """The workers of a router's config, checked and polled while started."""

    def __init__(self, config: RouterConfig) -> None:
        self.workers: list[Worker] = []
        for role, addresses in (("prefill", config.prefill), ("decode", config.decode)):
            for address in addresses:
                ch = channel(address, config.tls)
                stub = _STUBS[role](ch)
                self.workers.append(
                    Worker(address, role, channel=ch, stub=stub, health_stub=HealthStub(ch))
                )
        self.health_interval_s = config.health_interval_s
        self.stats_interval_s = config.stats_interval_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for w in self.workers:
            self._tasks.append(asyncio.create_task(self._watch(w)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()

    def healthy(self, role: str) -> list[Worker]:
        """In `role`'s rotation: healthy, and not changing role."""
        return [w for w in self.workers if w.role == role and w.healthy and not w.switching]

    def find(self, address: str) -> Worker | None:
        return next((w for w in self.workers if w.address == address), None)

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    async def _watch(self, w: Worker) -> None:
        next_stats = 0.0
        loop = asyncio.get_running_loop()
        while True:
            ok = await self._check(w)
            if ok != w.healthy:
                w.healthy = ok
                metrics.worker_health(w.role, w.address, ok)
                log.info(
                    "%s worker %s %s the rotation", w.role, w.address, "joins" if ok else "leaves"
                )
            if ok and loop.time() >= next_stats:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    epoch = w.role_epoch
                    load = await w.stub.GetStats(  # type: ignore[attr-defined]
                        worker_pb2.StatsRequest(), timeout=self.health_interval_s
                    )
                    self._note_restart(w, load)
                    w.load = load
                    if load.role in _STUBS and not w.switching and w.role_epoch == epoch:
                        w.take_role(load.role)
                next_stats = loop.time() + self.stats_interval_s
            await asyncio.sleep(min(self.health_interval_s, self.stats_interval_s))

    @staticmethod
    def _note_restart(w: Worker, load: worker_pb2.WorkerStats) -> None:
        before, now = w.load.process_start_unix_s, load.process_start_unix_s
        if before and now and now != before:
            metrics.worker_restarted(w.role, w.address)
            log.warning("%s worker %s restarted (a new process)", w.role, w.address)

    async def _check(self, w: Worker) -> bool:
        try:
            reply = await w.health_stub.Check(  # type: ignore[union-attr]
                health_pb2.HealthCheckRequest(service=""), timeout=self.health_interval_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
