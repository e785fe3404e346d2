"""A follower rank of a tensor- or pipeline-parallel worker: `python -m
pdmesh.engine.executor.follower`, or `serve_rank` inside a Ray actor
(engine/executor/ray_actors.py).

It loads its shard of the model, builds the KV connector rank 0 names (if any), and then runs
whatever rank 0 broadcasts: steps (the same forward as rank 0 on its shard, with the step's KV
plan), control messages (the engine's own, or the connector's: e.g. registering a KV transfer on
this rank's receiver), or stop. A control message that fails is answered with `Failed`, which
rank 0 raises; the follower goes on.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pdmesh import envs
from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.eplb.balancer import CountEplb
from pdmesh.engine.executor import step_codec
from pdmesh.engine.executor.base import FollowerSpec
from pdmesh.engine.executor.driver import (
    OP_CONTROL,
    OP_STEP,
    OP_STOP,
    CountExperts,
    ExpertCounts,
    init_ranks,
    rank_device,
)
from pdmesh.engine.executor.profiling import ProfileRank, RankProfiler, span
from pdmesh.engine.kv_cache.host.pool import OffloadNow
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.parallel.comm import broadcast_bytes, destroy, gather_bytes
from pdmesh.engine.parallel.step_channel import StepChannel
from pdmesh.engine.runner.model_runner import ModelRunner
from pdmesh.kv_transfer.connector import (
    Failed,
    KVConnector,
    create_connector,
    decode,
    encode,
    on_node,
)
from pdmesh.logger import get_logger
from pdmesh.processes import die_with_parent, exit_service

log = get_logger(__name__)


def serve_rank(spec: dict[str, Any]) -> None:
    """Run one follower rank until rank 0 stops it; `spec`: a `FollowerSpec`'s fields (its JSON,
    decoded), from a process's environment or a Ray actor's argument."""
    s = FollowerSpec(**spec)
    config = EngineConfig(**s.engine)
    device = rank_device(torch.device(s.device), s.local_rank)
    info = ModelInfo.load(resolve_model_folder(config.model))
    group, tp, stage = init_ranks(s.rank, config, s.init_method, device, info.num_layers)
    channel = StepChannel(group, step_codec.FIRST_LEN)  # as rank 0 builds it, at this point
    options = decode(s.kv_connector.encode())
    if options is not None and s.kv_host is not None:  # on another node than rank 0
        options = on_node(options, s.kv_host, s.kv_advertise)
    connector = create_connector(options) if options is not None else None
    max_len = config.max_len_for(info.max_position)
    runner = ModelRunner(info, config, device, max_len, tp, connector, stage=stage)
    profiler = RankProfiler()
    try:
        while True:
            with span("follower.wait_step"):
                header = step_codec.receive_header(channel)
            op = header.fields["op"]
            if op == OP_STEP:
                with span("follower.receive_step"):
                    inputs, plan = step_codec.receive_step(header, group, device)
                with span("follower.run_step"):
                    runner.follow_step(inputs, plan)
            elif op == OP_CONTROL:
                message = decode(broadcast_bytes(None, group))
                if isinstance(message, ProfileRank):
                    reply = _profile(profiler, message, group.rank)
                else:
                    reply = _control(runner, connector, message)
                gather_bytes(encode(reply), group)
            elif op == OP_STOP:
                return
            else:
                raise RuntimeError(f"unknown op {op} from rank 0")
    finally:
        if connector is not None:
            connector.close()
        destroy()


def _control(runner: ModelRunner, connector: KVConnector | None, message: object) -> object:
    """The reply to one control message; a failure is a `Failed` reply, raised on rank 0."""
    try:
        if isinstance(message, CountExperts):
            return ExpertCounts(tuple(runner.expert_counts() or ()))
        if isinstance(message, CountEplb) and runner.balancer is not None:
            return runner.balancer.counts()
        if isinstance(message, OffloadNow) and runner.host_pool is not None:
            runner.host_pool.offload_now(runner.kv_cache.data, list(message.pairs))
            return None
        if connector is None:
            raise RuntimeError(f"control message {message!r} needs a KV connector")
        return connector.handle(message)
    except Exception as e:
        log.warning("control message %r failed on rank %d: %s", message, runner.tp.rank, e)
        return Failed.of(e)


def _profile(profiler: RankProfiler, message: ProfileRank, rank: int) -> object:
    try:
        profiler.handle(message, rank)
        return None
    except Exception as e:
        log.warning("profiling rank %d failed: %s", rank, e)
        return Failed.of(e)


def main() -> None:
    die_with_parent()
    serve_rank(json.loads(envs.tp_spec()))
    # Told to stop and torn down: leave without the interpreter's and the C++ libraries' exit
    # handlers, one of which sometimes aborts ("terminate called without an active exception",
    # SIGABRT) on a library thread left joinable, turning a clean stop into a failed rank.
    exit_service(0)


if __name__ == "__main__":
    main()
