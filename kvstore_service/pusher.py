"""A `push` for `KVStoreClient.publish` from one rank's KV cache, with that rank's KV sender.

The store's transfer completes once every layer and KV head of every block arrived: a worker of
one rank pushes everything with one such push; a worker of several ranks has each rank push its
own heads and layers to the same target (what the worker's wiring will do), and the store counts
them together. The blocks read must stay as they are until the push returns (hold them, or push
from a copy); a push that fails leaves nothing in the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from pdmesh.kv_transfer.base import KVSender
from pdmesh.kvstore_service.client import Push
from pdmesh.kvstore_service.types import PutTarget


def push_blocks(
    target: PutTarget, sender: KVSender, cache: torch.Tensor, block_ids: Sequence[int]
) -> None:
    """Push `target`'s run from `cache` [num_layers, 2, num_blocks, block_size, heads, head_dim]
    (this rank's; `sender` has its geometry), `block_ids[j]` holding the run's block j: every
    frame acknowledged on return, else TransferError. Blocking (a thread, not the loop)."""
    if len(block_ids) != target.num_blocks:
        raise ValueError(f"{len(block_ids)} block ids for a run of {target.num_blocks} blocks")
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=cache.device)
    handle = sender.start(target.endpoint, target.transfer_id, target.token, target.num_blocks)
    try:
        sender.send_layers([handle], 0, cache, ids)
    except BaseException:
        sender.abort(handle)
        raise
    sender.finish(handle, target.timeout_s)


def cache_pusher(
    sender: KVSender, cache: torch.Tensor, block_ids: Sequence[int], first_block: int = 0
) -> Push:
    """The `push` of an offer from `first_block`: `block_ids[j]` is the cache block holding
    offered block first_block + j."""
    block_ids = list(block_ids)

    async def push(target: PutTarget) -> None:
        start = target.first_block - first_block
        run = block_ids[start : start + target.num_blocks]
        await asyncio.to_thread(push_blocks, target, sender, cache, run)

    return push
