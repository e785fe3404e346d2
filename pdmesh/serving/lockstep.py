"""The data-parallel ranks of a mesh worker under data-parallel attention (an MoE model with
`enable_expert_parallel` and `--data-parallel-size N`): each rank is a worker of its own (its
gRPC port, requests, KV cache and KV plane), and their MoE layers split the experts, so they
step in lockstep. Every engine step starts with one agreement over their MoE group
(engine/runner/model_runner.py); a rank with nothing to run joins its peers' steps with padding
rows, and while no rank has work each waits for a command up to the engine loop's idle tick
before the next agreement.

`PeerWake` shortens that wait: a rank that gets work while the group is idle tells the others,
so that they join its first step at once instead of at their next tick. Each rank binds a
ZeroMQ PULL socket on loopback (the ranks of a worker share a node), publishes its address in
the group's rendezvous store and pushes one byte to each peer; a wake that finds a full queue
is dropped (one pending wake is enough).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import zmq

from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.data_parallel.group import join_mesh_group, moe_data_parallel
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.kv_transfer.connector import KVConnector
from pdmesh.logger import get_logger
from pdmesh.serving.data_parallel import DataParallelRank

log = get_logger(__name__)
POLL_MS = 200  # how often the receiving thread checks that it should stop


def rank_engine(
    config: EngineConfig, connector: KVConnector, dp: DataParallelRank | None
) -> LLMEngine:
    """The engine of a worker, or of one data-parallel rank of it: under data-parallel attention
    it joins its peers' MoE group; a dense model's ranks are engines of their own."""
    if dp is None or config.data_parallel_size == 1:
        return LLMEngine(config, connector)
    info = ModelInfo.load(resolve_model_folder(config.model))
    if not moe_data_parallel(config, info):
        return LLMEngine(config, connector)
    group = join_mesh_group(config, dp.rank, dp.address)
    return LLMEngine(config, connector, moe_group=group)


class PeerWake:
    """Callers may rely on: `notify()` from any thread returns at once; each peer's `on_wake`
    runs (on its receiving thread) soon after, at least once per `notify` that found it idle;
    `close()` stops the thread and the sockets."""

    def __init__(self, group: ParallelGroup, on_wake: Callable[[], None]) -> None:
        context = zmq.Context.instance()
        self._pull = context.socket(zmq.PULL)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        group.store.set(_key(group.rank), f"tcp://127.0.0.1:{port}")
        self._push: list[zmq.Socket[bytes]] = []
        for peer in range(group.size):
            if peer == group.rank:
                continue
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(group.store.get(_key(peer)).decode())  # waits for the peer to publish
            self._push.append(sock)
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe
        self._on_wake = on_wake
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="dp-wake", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        with self._lock:
            for sock in self._push:
                with contextlib.suppress(zmq.Again):  # a wake is already queued there
                    sock.send(b"w", zmq.NOBLOCK)

    def _receive(self) -> None:
        while not self._stopped.is_set():
            if self._pull.poll(POLL_MS):
                while self._pull.poll(0):
                    self._pull.recv()
                self._on_wake()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(2 * POLL_MS / 1000)
        with self._lock:
            for sock in self._push:
                sock.close()
        self._pull.close(linger=0)


def _key(rank: int) -> str:
    return f"pdmesh/dp_wake/{rank}"
