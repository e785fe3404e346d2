"""Prompt prefixes whose KV comes from outside the engine (a KV store), and the computed blocks a
service reads out of the engine to share: what a worker calls, on the engine thread.

Protocol: `hold_blocks(engine, n)` takes free device blocks that no sequence holds; something
outside (a KV receiver) writes KV into them; then `publish_held(engine, prompt, first_block,
ids)` puts them in the prefix cache as full blocks first_block, ... of `prompt` (and frees them:
the next request with that prefix adopts them through the normal prefix match), or
`release_held(engine, ids)` gives them back unpublished when the KV did not come or is not to be
trusted. `snapshot_prefix(engine, prompt, first_block)` copies the device blocks holding full
blocks first_block, ... of a prompt out of the cache, so a slow reader (a push to a store) never
races a step that reuses them.

Only for an engine of one rank: the other ranks of a tensor- or pipeline-parallel worker hold
their own heads and layers, which these functions do not reach.
"""

from __future__ import annotations

import torch

from pdmesh.engine.llm_engine import LLMEngine


def check_single_rank(engine: LLMEngine, what: str) -> None:
    """ValueError naming `what` unless the engine runs on one rank."""
    c = engine.config
    if c.world_size != 1:
        raise ValueError(
            f"{what} needs a worker of one rank for now (tensor and pipeline parallel size 1, "
            f"got {c.tensor_parallel_size} x {c.pipeline_parallel_size})."
        )


def held_prefix_blocks(engine: LLMEngine, prompt: list[int]) -> int:
    """Leading full blocks of `prompt` this worker holds now (device cache and host tier), as
    its prefix match counts them (the last token is always computed)."""
    return engine.cached_prefix_tokens(prompt) // engine.config.block_size


def hold_blocks(engine: LLMEngine, n: int) -> list[int] | None:
    """`n` device blocks to be written from outside, or None when the waiting requests need the
    free blocks now. Cached blocks among them are copied to the host tier first."""
    ids = engine.scheduler.hold_free(n)
    if ids is not None:
        engine.runner.offload_now(engine.scheduler.take_offloads())
    return ids


def publish_held(engine: LLMEngine, prompt: list[int], first_block: int, ids: list[int]) -> int:
    """The held blocks `ids` hold full blocks first_block, ... of `prompt`: they join the prefix
    cache (those another block holds already do not) and are freed. How many joined."""
    return engine.scheduler.blocks.publish_held(prompt, first_block, ids)


def release_held(engine: LLMEngine, ids: list[int]) -> None:
    engine.scheduler.blocks.release_held(ids)


def snapshot_prefix(
    engine: LLMEngine, prompt: list[int], first_block: int
) -> tuple[int, torch.Tensor] | None:
    """A copy of the device blocks holding full blocks first_block, ... of `prompt` (as far as
    the device cache holds them in a row from the first): (how many, the copy
    [num_layers, 2, n, block_size, kv_heads, head_dim]), or None when it holds none of them."""
    ids = engine.scheduler.blocks.cached_blocks(prompt)[first_block:]
    if not ids:
        return None
    cache = engine.runner.kv_cache.data  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
    index = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    return len(ids), cache.index_select(2, index)
