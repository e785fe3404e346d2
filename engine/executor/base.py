"""The contract of a rank launcher, the spec a follower rank starts from, and the registry of
`distributed_executor_backend` names.

Rank 0 (the process that runs the scheduler, and in a service the gRPC server) hosts a TCPStore
the ranks meet at and hands a launcher the spec of its followers; the launcher starts them
wherever its backend puts them and tells rank 0's monitor when one stops. A spec travels as
JSON only: in a process's environment, as a Ray actor's string argument, in the store.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pdmesh.engine.config import EngineConfig


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower rank starts from. `device` is the base device of the rank's node: local
    rank l runs on cuda:(index + l) (on a CPU, the CPU). `kv_host`: set for a rank on another
    node than rank 0, whose KV receivers then bind that host (a free port) and advertise
    `kv_advertise` (HOST; None: the bound address) instead of rank 0's."""

    engine: dict[str, Any]  # EngineConfig's fields
    init_method: str  # tcp://HOST:PORT of rank 0's store
    device: str
    kv_connector: str  # the KV connector's options, in the connector's JSON codec
    rank: int = 0
    local_rank: int = 0
    kv_host: str | None = None
    kv_advertise: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> FollowerSpec:
        return FollowerSpec(**json.loads(text))


class RankLauncher(ABC):
    """Starts rank 0's followers and watches them. Callers may rely on: `rendezvous` first,
    then `start` once; `poll` from a monitor thread (it never blocks for long) until `stop`;
    `stop` once, after rank 0 told the ranks to stop (or found one dead): no rank it started
    runs after it returns."""

    @abstractmethod
    def rendezvous(self) -> tuple[str, int]:
        """(the host every rank reaches rank 0's store at, the port it listens on; 0: any)."""

    @abstractmethod
    def start(self, spec: FollowerSpec, store: dist.TCPStore) -> None:
        """Start ranks 1 .. world_size - 1 from `spec` (its rank fields are filled in here).
        `store` is rank 0's, which the ranks join."""

    @abstractmethod
    def poll(self) -> str | None:
        """A sentence naming a rank that stopped, or None while every rank runs."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to stop, then end those still running."""


_BACKENDS: dict[str, Callable[[EngineConfig], RankLauncher]] = {}


def register_backend(
    name: str,
) -> Callable[[Callable[[EngineConfig], RankLauncher]], Callable[[EngineConfig], RankLauncher]]:
    def register(
        make: Callable[[EngineConfig], RankLauncher],
    ) -> Callable[[EngineConfig], RankLauncher]:
        _BACKENDS[name] = make
        return make

    return register


def create_launcher(config: EngineConfig) -> RankLauncher:
    # Imported here: each backend module registers itself, and Ray is imported only if asked for.
    if config.distributed_executor_backend == "ray":
        from pdmesh.engine.executor import ray_actors  # noqa: F401
    else:
        from pdmesh.engine.executor import nodes  # noqa: F401
    return _BACKENDS[config.distributed_executor_backend](config)
