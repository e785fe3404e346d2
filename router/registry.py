"""The workers the router knows, with grpc.health.v1 checks and load from their stats RPC.

A worker enters the rotation when its health check says SERVING and leaves it when a check
fails or says otherwise; checks keep running, so it comes back when healthy again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.logger import get_logger
from pdmesh.router.prefix_index import PrefixIndex
from pdmesh.serving.grpc_server import channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)


@dataclass
class Load:
    """The last stats a worker reported."""

    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    num_running: int = 0
    num_waiting: int = 0
    block_size: int = 0


@dataclass(eq=False)
class Worker:
    address: str
    role: str  # "prefill" or "decode"
    healthy: bool = False
    load: Load = field(default_factory=Load)
    # Blocks this router sent the worker that its last stats may not show yet.
    inflight_blocks: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    channel: grpc.aio.Channel | None = None
    stub: object = None
    health_stub: health_pb2_grpc.HealthStub | None = None

    @property
    def kv_usage(self) -> float:
        total = self.load.kv_blocks_total or 1
        return (self.load.kv_blocks_used + self.inflight_blocks) / total


class WorkerRegistry:
    def __init__(
        self,
        prefill: tuple[str, ...],
        decode: tuple[str, ...],
        health_interval_s: float,
        stats_interval_s: float,
        tls: TLSConfig | None = None,
    ) -> None:
        self.workers: list[Worker] = []
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                ch = channel(address, tls)
                stub_cls = (
                    worker_pb2_grpc.PrefillWorkerStub
                    if role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub
                )
                self.workers.append(
                    Worker(
                        address,
                        role,
                        channel=ch,
                        stub=stub_cls(ch),
                        health_stub=health_pb2_grpc.HealthStub(ch),
                    )
                )
        self.health_interval_s = health_interval_s
        self.stats_interval_s = stats_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()  # set on every rotation change

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
        return [w for w in self.workers if w.role == role and w.healthy]

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    async def wait_healthy(self, prefill: int, decode: int, timeout_s: float) -> None:
        async def ready() -> None:
            while len(self.healthy("prefill")) < prefill or len(self.healthy("decode")) < decode:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(ready(), timeout_s)

    async def _watch(self, w: Worker) -> None:
        next_stats = 0.0
        loop = asyncio.get_running_loop()
        while True:
            ok = await self._check(w)
            if ok != w.healthy:
                w.healthy = ok
                log.info(
                    "%s worker %s %s the rotation", w.role, w.address, "joins" if ok else "leaves"
                )
                self.changed.set()
            if ok and loop.time() >= next_stats:
                await self._poll_stats(w)
                next_stats = loop.time() + self.stats_interval_s
            await asyncio.sleep(min(self.health_interval_s, self.stats_interval_s))

    async def _check(self, w: Worker) -> bool:
        try:
            reply = await w.health_stub.Check(  # type: ignore[union-attr]
                health_pb2.HealthCheckRequest(service=""), timeout=self.health_interval_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _poll_stats(self, w: Worker) -> None:
        try:
            s = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=self.health_interval_s)  # type: ignore[attr-defined]
        except grpc.aio.AioRpcError:
            return
        w.load = Load(
            s.kv_blocks_total, s.kv_blocks_used, s.num_running, s.num_waiting, s.block_size
        )
