"""The `ray` backend: follower ranks as Ray actors on a Ray cluster (`ray start --head`, then
`ray start --address=HEAD:6379` on every other node).

One placement-group bundle per pipeline stage, each of tensor_parallel_size devices (GPUs, or
CPUs on a machine without them), spread over nodes: a stage's TP ranks share a node, stages go
to different nodes where the cluster has them. Rank 0 (this process) is not an actor; it is stage
0's first rank, so stage 0 takes the bundle Ray put on this node. Each actor runs the same
`serve_rank` as a follower process, its spec passed as a JSON string; the ranks meet at this
node's IP (not 127.0.0.1). Rank 0's monitor watches each actor's `run` call: an actor that dies
(its process killed, its node lost) ends that call, which `ray.wait` reports at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch.distributed as dist

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.executor.base import FollowerSpec, RankLauncher, register_backend
from pdmesh.logger import get_logger

log = get_logger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


class RankActor:
    """A follower rank inside a Ray actor (wrapped with `ray.remote` when the backend starts)."""

    def describe(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        return {"node_id": context.get_node_id(), "ip": ip, "pid": os.getpid()}

    def run(self, spec: str) -> None:
        from pdmesh.engine.executor.follower import serve_rank

        serve_rank(json.loads(spec))


@register_backend("ray")
def _ray(config: EngineConfig) -> RankLauncher:
    return RayRanks(config)


def connect(config: EngineConfig) -> None:
    """Join the Ray cluster this node belongs to, or start a local one if none runs."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", logging_level="WARNING")
    except ConnectionError:
        log.info("no Ray cluster running: starting a local one")
        gpu = config.torch_device().type == "cuda"
        # Logical CPUs: on a CPU-only machine every rank takes one, as processes would.
        cpus = None if gpu else max(os.cpu_count() or 1, config.world_size)
        ray.init(num_cpus=cpus, logging_level="WARNING")


class RayRanks(RankLauncher):
    """After `start`: `node_ids[r]` is the Ray node rank r runs on, `pids[r]` its process."""

    def __init__(self, config: EngineConfig) -> None:
        import ray

        connect(config)
        self.config = config
        self.gpu = config.torch_device().type == "cuda"
        self.here = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()
        self.node_ids: list[str] = [self.here]
        self.pids: list[int] = [os.getpid()]
        self._group: Any = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []

    def rendezvous(self) -> tuple[str, int]:
        return self.host, 0

    def start(self, spec: FollowerSpec, store: dist.TCPStore) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp, size = self.config.tensor_parallel_size, self.config.world_size
        bundle_of_stage = self._place()
        actor_class = ray.remote(RankActor)
        unit = {"num_gpus": 1} if self.gpu else {"num_cpus": 1}
        env = {k: v for k, v in os.environ.items() if k.startswith("PDMESH_")}
        # Stage 0 shares its node with rank 0, which is no actor and already runs on cuda:K: its
        # actors see every GPU and take cuda:(K + rank), as local processes would, rather than
        # the GPU Ray would pick, which may be rank 0's own. Other stages' actors take Ray's.
        stage0_env = {**env, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        for rank in range(1, size):
            bundle = bundle_of_stage[rank // tp]  # a stage's TP ranks share its bundle's node
            strategy = PlacementGroupSchedulingStrategy(self._group, bundle)
            runtime_env = {"env_vars": stage0_env if rank < tp else env}
            options = dict(unit, scheduling_strategy=strategy, runtime_env=runtime_env)
            self._actors.append(actor_class.options(**options).remote())
        where = ray.get([a.describe.remote() for a in self._actors])
        for rank, (actor, at) in enumerate(zip(self._actors, where, strict=True), start=1):
            self.node_ids.append(at["node_id"])
            self.pids.append(at["pid"])
            # Off stage 0, Ray gives a GPU actor its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES).
            on_stage0 = rank < tp
            rank_spec = dataclasses.replace(
                spec,
                rank=rank,
                local_rank=rank if on_stage0 else 0,
                device="cuda" if self.gpu and not on_stage0 else spec.device,
                kv_host=at["ip"] if at["node_id"] != self.here else None,
            )
            self._runs.append(actor.run.remote(rank_spec.to_json()))
        log.info("ray: ranks on nodes %s", [n[:8] for n in self.node_ids])

    def _place(self) -> list[int]:
        """Reserve the stages' bundles; the bundle of each stage (stage 0: one on this node)."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        resource = "GPU" if self.gpu else "CPU"
        self._group = placement_group([{resource: float(tp)}] * pp, strategy="SPREAD")
        ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"Ray could not place {pp} pipeline stage(s) of {tp} {resource}(s) each within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}."
            )
        nodes = placement_group_table(self._group)["bundles_to_node_id"]
        local = [i for i in sorted(nodes) if nodes[i] == self.here]
        if not local:
            raise ValueError(
                f"Ray placed no pipeline stage on this node, where rank 0 runs stage 0: free "
                f"{tp} {resource}(s) here (this node: {self.here[:8]})."
            )
        return [local[0], *(i for i in sorted(nodes) if i != local[0])]

    def poll(self) -> str | None:
        import ray

        if not self._runs:
            return None
        ready, _ = ray.wait(self._runs, num_returns=1, timeout=0)
        if not ready:
            return None
        rank = self._runs.index(ready[0]) + 1
        try:
            ray.get(ready[0])
            why = "it returned"
        except Exception as e:  # the actor's death, or serve_rank's error
            why = str(e).splitlines()[0]
        return f"rank {rank} (a Ray actor on node {self.node_ids[rank][:8]}) stopped: {why}"

    def stop(self, timeout_s: float) -> None:
        import ray

        try:
            if self._runs:
                ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
            for actor in self._actors:
                ray.kill(actor)
            if self._group is not None:
                ray.util.remove_placement_group(self._group)
        except Exception as e:  # the cluster went away first: nothing of ours is left on it
            log.warning("could not stop the Ray ranks cleanly: %s", e)
