"""The skeleton every worker process shares (decode and prefill): the engine with its KV
connector on its own thread, a fatal error or a dead tensor-parallel rank taking the process
down, Prometheus and GetStats figures, and `serve_worker` running it all behind gRPC until a
signal. A service keeps only what differs: its requests, its KV side, its extra figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol, TypeVar

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.errors import Unavailable
from pdmesh.kv_transfer.connector import KVConnector
from pdmesh.kv_transfer.stats import ReceiverStats, SenderStats
from pdmesh.logger import get_logger
from pdmesh.observability import tracing
from pdmesh.observability.metrics_server import MetricsServer
from pdmesh.observability.worker_collector import EplbFigures, TransferTotals, WorkerSnapshot
from pdmesh.processes import freeze_heap
from pdmesh.serving.engine_loop import EngineLoop
from pdmesh.serving.grpc_server import Health, ServiceSpec, build_server
from pdmesh.serving.lockstep import DataParallelRank, PeerWake, rank_engine
from pdmesh.serving.runner import serve_until_stopped
from pdmesh.serving.store_link import StoreLink, StoreOptions
from pdmesh.serving.tls import TLSConfig

log = get_logger(__name__)
# GetStats reports it: a router that sees it change counts a restart of this worker.
PROCESS_START_UNIX_S = time.time()


class WorkerProcess(ABC):
    """Rank 0 of a worker. Callers may rely on: `start` once on the event loop, then requests;
    `stopped` is set (on the event loop) when the engine fails or a rank dies, and the process
    should then exit; `close` stops the engine thread, the connector and the other ranks."""

    role: ClassVar[str]  # "decode" / "prefill": metrics labels and GetStats
    metrics: Any  # the service's metrics; `metrics.registry` is served at /metrics
    prefills: dict[str, int]  # prompts prefilled, by where (local, remote, fallback)

    def __init__(
        self,
        engine: LLMEngine,
        connector: KVConnector,
        on_tick: Callable[[LLMEngine], None] | None = None,
        store: StoreOptions | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        """on_tick: run between steps and when idle, on the engine thread. store: the KV store
        to read through and write behind (serving/store_link.py), reached with `tls`."""
        self.engine = engine
        self.connector = connector
        self._store_options, self._store_tls = store, tls
        self.store: StoreLink | None = None  # made by `start`, on the event loop
        self.geometry = connector.geometry  # bound when the engine was built
        # A data-parallel rank under data-parallel attention steps with its peers (lockstep.py).
        lockstep = engine.runner.dp is not None
        # A burst is kept together where decode runs (burst.py); `role` is read at each wake,
        # as a worker that switches roles changes it.
        self.loop = EngineLoop(
            engine,
            self._on_engine_deltas,
            on_tick,
            self._on_fatal,
            lockstep=lockstep,
            gathers_bursts=lambda: self.role != "prefill",
        )
        self.peers: PeerWake | None = None
        if engine.runner.dp is not None:  # waits for every peer to publish its address
            self.peers = PeerWake(engine.runner.dp, self.loop.wake)
            self.loop.wake_peers = self.peers.notify
        if engine.tp_driver is not None:  # a dead rank stops the engine from any thread
            engine.tp_driver.on_rank_death = self.loop.fail
        self.fatal: BaseException | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self.health: Health | None = None  # the server's health service, once it serves
        self.data_parallel_rank = 0  # which of its worker's data-parallel ranks (serve_worker)

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self.stopped = asyncio.Event()
        self.loop.start()
        if self._store_options is not None:
            opts, tls = self._store_options, self._store_tls
            self.store = StoreLink(opts, self.engine, self.loop, self.geometry, tls)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        self.loop.stop()
        if self.peers is not None:
            self.peers.close()
        self.connector.close()
        self.engine.close()

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self.stopped.set)

    def check_serving(self) -> None:
        """Unavailable once the engine has failed."""
        if self.fatal is not None:
            raise Unavailable(f"this {self.role} worker's engine failed")

    # -- what a service adds ------------------------------------------------------------------
    @abstractmethod
    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        """Each step's deltas, on the engine thread."""

    async def before_server_stop(self) -> None:
        """What ends before the gRPC server stops (nothing; a decode worker's token streams)."""
        return None

    def banner(self) -> str:
        """What the start-up log line adds after the port."""
        return ""

    # -- figures ------------------------------------------------------------------------------
    def transfer_totals(self) -> list[TransferTotals]:
        """Rank 0's KV transfer counters per transport (any thread)."""
        return [_totals(n, s) for n, s in self.transfer_stats()]

    def transfer_stats(self) -> list[tuple[str, SenderStats | ReceiverStats]]:
        """Rank 0's KV senders' and receivers' counters, with their transports (any thread)."""
        return list(self.connector.stats_by_transport().items())

    def metrics_snapshot(self) -> WorkerSnapshot:
        """State for a Prometheus scrape, read from the scraping thread (no engine wait)."""
        return WorkerSnapshot(
            dataclasses.asdict(self.engine.stats()),
            self.transfer_totals(),
            expert_token_counts=self.engine.runner.expert_counts() or (),
            prefills=dict(self.prefills),
            eplb=_eplb_figures(self.engine),
            store=self.store.figures() if self.store is not None else None,
        )

    async def report(self) -> dict[str, Any]:
        """The fields of a WorkerStats message (GetStats)."""

        def read(e: LLMEngine) -> dict[str, Any]:
            moved = "kv_bytes_received" if self.connector.receives else "kv_bytes_sent"
            totals = self.transfer_totals()
            return {
                **dataclasses.asdict(e.stats()),
                moved: self.connector.bytes_moved(),  # every rank's
                "kv_seconds": sum(t.seconds for t in totals),
                "kv_transfers": sum(t.transfers for t in totals),
                "kv_frames_dropped": sum(t.frames_dropped for t in totals),
                **{_PREFILL_FIELDS[where]: n for where, n in self.prefills.items()},
                "expert_token_counts": e.expert_counts() or [],
                **_eplb_fields(e),
                **_fork_fields(e),
            }

        fields = await self.loop.acall(read)
        return {
            "role": self.role,
            "roles": [self.role],
            **fields,
            **(self.store.figures() if self.store is not None else {}),
            "block_size": self.geometry.block_size,
            "tensor_parallel_size": self.engine.config.tensor_parallel_size,
            "pipeline_parallel_size": self.engine.config.pipeline_parallel_size,
            "process_start_unix_s": PROCESS_START_UNIX_S,
            "data_parallel_size": self.engine.config.data_parallel_size,
            "data_parallel_rank": self.data_parallel_rank,
            "data_parallel_attention": self.engine.runner.dp is not None,
        }


def _eplb_figures(engine: LLMEngine) -> EplbFigures | None:
    """EPLB's figures as of its last rebalance (any thread: nothing asked of the ranks)."""
    balancer = engine.runner.balancer
    if balancer is None:
        return None
    s = balancer.published
    return EplbFigures(s.physical_expert_tokens, s.rebalances, s.imbalance)


def _eplb_fields(engine: LLMEngine) -> dict[str, Any]:
    """EPLB's WorkerStats fields, read from every rank now (engine thread)."""
    s = engine.eplb_stats()
    if s is None:
        return {}
    return {
        "physical_expert_token_counts": list(s.physical_expert_tokens),
        "eplb_rebalances": s.rebalances,
        "eplb_imbalance": s.imbalance,
    }


def _fork_fields(engine: LLMEngine) -> dict[str, int]:
    forks = engine.fork_stats()
    return {"fork_blocks_shared": forks.blocks_shared, "fork_blocks_copied": forks.blocks_copied}


_PREFILL_FIELDS = {
    "local": "local_prefills",
    "remote": "remote_prefills",
    "fallback": "prefill_fallbacks",
}


def _totals(transport: str, s: SenderStats | ReceiverStats) -> TransferTotals:
    if isinstance(s, SenderStats):
        return TransferTotals(
            "send", transport, s.bytes_sent, s.seconds_sending, s.transfers, s.transfers_failed
        )
    return TransferTotals(
        "receive",
        transport,
        s.bytes_received,
        s.seconds_receiving,
        s.transfers_completed,
        s.transfers_failed,
        s.frames_dropped,
    )


class WorkerSettings(Protocol):
    """What `serve_worker` reads of a service's config."""

    engine: Any
    bind: str
    metrics_bind: str | None
    tls: TLSConfig | None
    data_parallel: DataParallelRank | None


W = TypeVar("W", bound=WorkerProcess)


async def serve_worker(
    role: str,
    config: WorkerSettings,
    connector: KVConnector,
    make_worker: Callable[[LLMEngine], W],
    services: Callable[[W], list[ServiceSpec]],
    on_ready: Callable[[int], None] | None = None,
    on_sigterm: Callable[[W], Callable[[], Awaitable[object]]] | None = None,
) -> None:
    """Build the engine (off the event loop) with `connector`, the worker, its metrics
    endpoint and its gRPC server; serve until a signal or the worker's `stopped`. `on_sigterm`:
    what SIGTERM awaits (NOT_SERVING already) before the worker stops, e.g. a drain."""
    tracing.setup(f"pdmesh-{role}")
    try:
        engine = await asyncio.to_thread(
            rank_engine, config.engine, connector, config.data_parallel
        )
    except BaseException:
        connector.close()
        raise
    worker = make_worker(engine)
    if config.data_parallel is not None:
        worker.data_parallel_rank = config.data_parallel.rank
    worker.start(asyncio.get_running_loop())
    bind = config.metrics_bind
    metrics = MetricsServer(bind, worker.metrics.registry) if bind else None
    server, health, port = build_server(config.bind, services(worker), tls=config.tls)
    worker.health = health
    await server.start()
    freeze_heap()
    log.info("%s worker on port %d%s", role, port, worker.banner())
    if on_ready is not None:
        on_ready(port)

    async def stop() -> None:
        await worker.close()
        if metrics is not None:
            metrics.stop()
        tracing.shutdown()

    before_stop = on_sigterm(worker) if on_sigterm is not None else None
    await serve_until_stopped(
        server,
        health,
        stop,
        worker.stopped,
        on_sigterm=before_stop,
        before_server_stop=worker.before_server_stop,
    )
