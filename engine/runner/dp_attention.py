"""The model runner's part in expert parallelism and data-parallel attention
(engine/data_parallel/): the MoE group's exchange, chosen when the runner is built; the ranks'
agreement on each step's size; the rows a step's MoE layers run; and an idle rank's padding
step, which joins its peers' collectives.
"""

from __future__ import annotations

import dataclasses

import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.layers.attention import AttentionMetadata
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.runner.cuda_graphs import DecodeGraphs
from pdmesh.engine.runner.step_inputs import HostInputs


def moe_exchange(tp: ParallelGroup, config: EngineConfig, device: torch.device) -> ParallelGroup:
    """`tp` with its MoE group set up for expert parallelism: EPLB's redundant slots, and the
    exchange (engine/layers/moe.py): on GPUs the all-reduce, or the gather and reduce-scatter
    under data-parallel attention (no host sync, decode graphs), EPLB on or off; on CPUs the
    all-to-all, whose outputs are bit-identical with EPLB on and off (EPLB's tests hold it to
    that). Until 2026-11-27 EPLB kept GPUs on the all-to-all too, eager with a host sync per
    layer: 4.4x slower than EPLB off on two H100s, and its bf16 tokens differed from EPLB off's
    all the same (BENCHMARKS.md)."""
    moe = tp.moe_group
    if config.enable_eplb:  # the MoE layers hold E + R expert slots over the group
        moe = dataclasses.replace(moe, redundant_experts=config.num_redundant_experts)
    if moe.expert_parallel and moe.size > 1:
        moe = dataclasses.replace(moe, moe_all_reduce=device.type == "cuda")
    return dataclasses.replace(tp, moe=moe) if tp.moe is not None else moe


def agree(dp: ParallelGroup, num_tokens: int, fits: bool) -> tuple[int, bool]:
    """Over the data-parallel ranks, on the host: (the most tokens any rank runs this step,
    whether every rank's step fits a CUDA graph)."""
    with torch.profiler.record_function("dp.agree"):
        most, misfit = dp.fast["host_max"]([num_tokens, 0 if fits else 1])
    return most, not misfit


def note_rows(dp: ParallelGroup, meta: AttentionMetadata) -> None:
    """Under data-parallel attention: the rows the MoE layers are about to run, padding
    rows being those that store no KV (slot -1), which their exchange leaves out of the
    expert work (engine/layers/moe.py). In a graph's capture, the bucket's static buffer."""
    dp.fast["slots"] = meta.slot_mapping


def pad_idle_step(
    dp: ParallelGroup, graphs: DecodeGraphs | None, model: torch.nn.Module, device: torch.device
) -> bool:
    """A rank with nothing to run joins the step the other ranks run with padding rows only
    (a graph's bucket, or one eager token). False: no rank runs anything this step."""
    most, all_fit = agree(dp, 0, graphs is not None)
    if not most:
        return False
    if graphs is not None and all_fit:
        bs = graphs.bucket(most)
        dp.step_tokens[:] = [0, bs]
        graphs.run_padding(bs)
    else:
        # One token that stores nothing (slot -1) and reads one position of block 0.
        host = HostInputs([0], [0], [-1], [[0]], [1], [0], [], [], [])
        inputs = host.to_device(device, [])
        dp.step_tokens[:] = [most, 1]
        note_rows(dp, inputs.meta)
        model(inputs.input_ids, inputs.positions, inputs.meta, None)
    dp.step_tokens[1] = 0
    return True
