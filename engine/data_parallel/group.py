"""The MoE group of data-parallel ranks under data-parallel attention: which engines need one,
what they support so far, and joining it, for the offline front's replicas (`front.py`,
`replica.py`) and for the ranks of a data-parallel mesh worker (one process each, started with
`--data-parallel-rank` and `--data-parallel-address`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.parallel.comm import init_group, serve_store
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.host_max import HostMax


def moe_data_parallel(config: EngineConfig, info: ModelInfo) -> bool:
    """Whether `config`'s data-parallel ranks share their experts (an MoE model with
    enable_expert_parallel), stepping in lockstep; otherwise each rank is an engine of its own.
    ValueError when they would and the layout is one data-parallel attention lacks so far."""
    if config.data_parallel_size == 1 or not config.enable_expert_parallel:
        return False
    if info.num_experts == 0:
        return False
    if config.world_size > 1:
        raise ValueError(
            "data_parallel_size with enable_expert_parallel runs one rank per replica so far: "
            f"set tensor_parallel_size=1 and pipeline_parallel_size=1 (got "
            f"{config.tensor_parallel_size} and {config.pipeline_parallel_size})."
        )
    if config.speculative_config is not None:
        raise ValueError(
            "data_parallel_size with enable_expert_parallel does not support speculative "
            "decoding yet (the replicas step in lockstep)."
        )
    redundant = config.num_redundant_experts if config.enable_eplb else None
    info.check_data_parallel(config.data_parallel_size, True, redundant)
    return True


def moe_group(
    rank: int, size: int, init_method: str, device: torch.device, store: Any = None
) -> ParallelGroup:
    """The data-parallel ranks' MoE group (every rank, rank order), joined at `init_method`
    (tcp://HOST:PORT); `store`: rank 0's own, when it serves one already."""
    group = dataclasses.replace(
        init_group(rank, size, init_method, device, True, store), data_parallel=True
    )
    # The per-step agreement (engine/runner/model_runner.py `_agree`).
    group.fast["host_max"] = HostMax(group, 2)
    return group


def join_mesh_group(config: EngineConfig, rank: int, address: str) -> ParallelGroup:
    """A mesh worker's data-parallel rank joins its MoE group: rank 0 listens at `address`
    (HOST:PORT), the others connect to it (each waits for all)."""
    host, _, port = address.rpartition(":")
    size, device = config.data_parallel_size, config.torch_device()
    store = serve_store(host, int(port)) if rank == 0 else None
    return moe_group(rank, size, f"tcp://{address}", device, store)
