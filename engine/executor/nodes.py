"""The `mp` backend: follower ranks as processes, on this node or, as a static launch over
`nnodes` nodes (torchrun's names: --nnodes, --node-rank, --master-addr, --master-port), on
several. Node r runs ranks r*k .. r*k + k - 1 (k = world_size / nnodes); node 0's first rank is
rank 0, which serves.

Node 0 hosts the ranks' TCPStore at master_port and publishes the followers' spec there; every
other node runs `serve_node`, which reads the spec from it, starts its ranks, and beats a
heartbeat into the store every 0.2 s. A rank that exits on another node is written to the store
by its node, where rank 0's monitor reads it within a fraction of a second; a node whose
heartbeat stops (the machine lost) is declared dead after NODE_SILENT_S. A node exits when its
ranks stop (rank 0 told them) or when rank 0's store goes away.
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch.distributed as dist

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.executor.base import FollowerSpec, RankLauncher, register_backend
from pdmesh.engine.executor.processes import LocalRanks
from pdmesh.logger import get_logger

log = get_logger(__name__)

SPEC_KEY = "pdmesh/follower-spec"
DEAD_KEY = "pdmesh/dead"
HEARTBEAT_S = 0.2
NODE_SILENT_S = 5.0
# A node may start long before node 0 has read the model's config and opened its store.
JOIN_TIMEOUT = datetime.timedelta(minutes=30)


def _heartbeat_key(node: int) -> str:
    return f"pdmesh/heartbeat/{node}"


@register_backend("mp")
def _mp(config: EngineConfig) -> RankLauncher:
    return NodeZero(config) if config.nnodes > 1 else LocalLauncher(config)


class LocalLauncher(RankLauncher):
    """Every follower a process of this node, joined on 127.0.0.1."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.local: LocalRanks | None = None

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def start(self, spec: FollowerSpec, store: dist.TCPStore) -> None:
        self.local = LocalRanks(spec, range(1, self.config.world_size), 1)

    def poll(self) -> str | None:
        exited = self.local.exited() if self.local is not None else None
        if exited is None:
            return None
        return f"tensor-parallel rank {exited[0]} exited with code {exited[1]}"

    def stop(self, timeout_s: float) -> None:
        if self.local is not None:
            self.local.stop(timeout_s)


class NodeZero(RankLauncher):
    """Node 0 of a static launch: ranks 1 .. k-1 here, the other nodes' ranks watched through
    the store they report to."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.local: LocalRanks | None = None
        self.store: dist.Store | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last count, when it changed)

    def rendezvous(self) -> tuple[str, int]:
        return self.config.master_addr, self.config.master_port

    def start(self, spec: FollowerSpec, store: dist.TCPStore) -> None:
        store.set(SPEC_KEY, spec.to_json())
        # A connection of the monitor's own: a blocking wait of the ranks' rendezvous on the
        # main thread holds the one it was given.
        self.store = dist.TCPStore(
            self.config.master_addr, store.port, is_master=False, timeout=JOIN_TIMEOUT
        )
        self.local = LocalRanks(spec, range(1, self.config.ranks_per_node), 1)
        log.info(
            "node 0 of %d: waiting for the other nodes at %s:%d",
            self.config.nnodes,
            self.config.master_addr,
            self.config.master_port,
        )

    def poll(self) -> str | None:
        if self.local is not None and (exited := self.local.exited()) is not None:
            return f"rank {exited[0]} on node 0 exited with code {exited[1]}"
        if self.store is None:
            return None
        if self.store.check([DEAD_KEY]):
            return self.store.get(DEAD_KEY).decode()
        now = time.monotonic()
        for node in range(1, self.config.nnodes):
            count = self.store.add(_heartbeat_key(node), 0)
            last, since = self._beats.get(node, (0, now))
            if count != last:
                self._beats[node] = (count, now)
            elif count and now - since > NODE_SILENT_S:  # it had joined, then went silent
                return f"node {node} sent no heartbeat for {NODE_SILENT_S:.0f} s"
        return None

    def stop(self, timeout_s: float) -> None:
        # The other nodes' ranks stop on rank 0's stop message, or when its store goes away.
        if self.local is not None:
            self.local.stop(timeout_s)


def serve_node(config: EngineConfig, kv_host: str | None, kv_advertise: str | None) -> int:
    """Run node `config.node_rank` (> 0) of a static launch until its ranks stop: 0 when rank 0
    stopped them, 1 when one of them died or rank 0 went away. kv_host / kv_advertise: where this
    node's KV receivers bind and what they advertise (see FollowerSpec)."""
    node, k = config.node_rank, config.ranks_per_node
    log.info(
        "node %d of %d: joining %s:%d", node, config.nnodes, config.master_addr, config.master_port
    )
    store = dist.TCPStore(
        config.master_addr, config.master_port, is_master=False, timeout=JOIN_TIMEOUT
    )
    spec = FollowerSpec.from_json(store.get(SPEC_KEY).decode())
    _check_same_layout(config, EngineConfig(**spec.engine))
    spec = dataclasses.replace(
        spec, device=str(config.torch_device()), kv_host=kv_host, kv_advertise=kv_advertise
    )
    local = LocalRanks(spec, range(node * k, node * k + k), 0)
    try:
        while True:
            if local.clean():
                return 0  # rank 0 told every rank to stop
            if (failed := local.failed()) is not None:
                message = f"rank {failed[0]} on node {node} exited with code {failed[1]}"
                log.error(message)
                store.set(DEAD_KEY, message)
                return 1
            store.add(_heartbeat_key(node), 1)  # raises once rank 0's store is gone
            time.sleep(HEARTBEAT_S)
    except (RuntimeError, OSError) as e:  # torch's store errors are RuntimeErrors
        if local.clean():
            return 0  # rank 0 stopped them and closed its store before this node saw it
        log.error("node %d: rank 0 went away (%s); stopping this node's ranks", node, e)
        return 1
    finally:
        local.terminate()
        local.stop(10.0)


def _check_same_layout(mine: EngineConfig, node0: EngineConfig) -> None:
    ours = (mine.tensor_parallel_size, mine.pipeline_parallel_size, mine.nnodes)
    theirs = (node0.tensor_parallel_size, node0.pipeline_parallel_size, node0.nnodes)
    if ours != theirs:
        raise ValueError(
            "this node's tensor_parallel_size, pipeline_parallel_size, nnodes "
            f"{ours} differ from node 0's {theirs}: every node is started with the same layout."
        )
