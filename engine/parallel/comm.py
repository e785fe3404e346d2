"""Process groups for a tensor-parallel worker, and moving bytes between its ranks.

Rank 0 drives; the other ranks follow. Everything crosses as raw tensors (ints, bytes of JSON),
never pickle: `broadcast_bytes` / `gather_bytes` frame a byte string as a length then a uint8
tensor. Messages of host integers (step inputs, control) go over a gloo group of their own on
CPU tensors, also when the model's group is NCCL: a follower then reads them without waiting
for its GPU, and queues each step while the one before still runs. Only tensors that exist on
the device alone (a step's input ids sampled by the step before) go over the model's group.
"""

from __future__ import annotations

import datetime
import os
import urllib.parse

import torch
import torch.distributed as dist

from pdmesh import envs
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.kernels.cpu.threads import set_cpu_threads

# Followers wait idle in a broadcast for as long as rank 0 has nothing to do; a dead peer is
# noticed by process monitoring, not by collective timeouts.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def serve_store(host: str, port: int) -> dist.TCPStore:
    """Rank 0's store, which the other ranks join at tcp://HOST:PORT (port 0: a free one, read
    back from `.port`). It listens on every interface of this machine."""
    return dist.TCPStore(
        host, port, None, is_master=True, wait_for_workers=False, timeout=IDLE_TIMEOUT
    )


def init_group(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    expert_parallel: bool,
    store: dist.Store | None = None,
) -> ParallelGroup:
    """Join the group whose rank 0 listens at `init_method` (tcp://HOST:PORT): every rank of the
    worker (tensor and pipeline parallel). `store`: rank 0's own (`serve_store`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif envs.num_threads() is None:
        # Ranks on one CPU share its cores: more threads than cores only adds contention.
        set_cpu_threads((os.cpu_count() or 1) // size)
    if store is None:
        address = urllib.parse.urlsplit(init_method)
        store = dist.TCPStore(
            address.hostname, address.port, size, is_master=rank == 0, timeout=IDLE_TIMEOUT
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    host = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, size, dist.group.WORLD, host, store, expert_parallel, device)


def tp_group(world: ParallelGroup, tp: int) -> ParallelGroup:
    """The tensor-parallel group of `world`'s rank: its pipeline stage's `tp` ranks (`world`
    itself without pipeline parallelism). Every rank makes every stage's group, in order."""
    if tp == world.size:
        return world
    # No host group of its own: rank 0 reaches every rank through `world`'s.
    groups = [
        dist.new_group(list(range(s, s + tp)), timeout=IDLE_TIMEOUT)
        for s in range(0, world.size, tp)
    ]
    stage = world.rank // tp
    # A store of its own per stage (symmetric memory registers the group there: two stages
    # writing one key would read each other's names).
    store = dist.PrefixStore(f"tp-stage-{stage}", world.store) if world.store is not None else None
    return ParallelGroup(
        world.rank % tp, tp, groups[stage], None, store, world.expert_parallel, world.device
    )


def check_tp_size(size: int, num_heads: int, num_kv_heads: int) -> None:
    # Valid sizes split the query heads evenly and the KV heads evenly or by replication.
    valid = [
        n
        for n in range(1, num_heads + 1)
        if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]
    if size not in valid:
        raise ValueError(
            f"tensor_parallel_size {size} does not fit this model's {num_heads} attention heads "
            f"and {num_kv_heads} KV heads; valid sizes: {', '.join(map(str, valid))}."
        )


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without making the host wait for the GPU: a blocking host-to-device copy
    costs a stream sync, which on a per-step or per-layer path keeps the host from running
    ahead (pinned staging, then a non-blocking copy)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def broadcast_ints(values: list[int] | None, n: int, group: ParallelGroup) -> list[int]:
    """Rank 0's `n` ints to every rank (zero-padded), over the host group."""
    if group.rank == 0:
        assert values is not None and len(values) <= n
        padded = [*values, *[0] * (n - len(values))]
        dist.broadcast(torch.tensor(padded, dtype=torch.int64), 0, group=group.host_group)
        return padded
    t = torch.zeros(n, dtype=torch.int64)
    dist.broadcast(t, 0, group=group.host_group)
    return t.tolist()


def broadcast_host(
    t: torch.Tensor | None, numel: int, dtype: torch.dtype, group: ParallelGroup
) -> torch.Tensor:
    """Rank 0's flat CPU tensor to every rank's CPU (the others allocate `numel` of `dtype`),
    over the host group."""
    if group.rank == 0:
        assert t is not None
        buf = t.contiguous()
    else:
        buf = torch.empty(numel, dtype=dtype)
    if numel:
        dist.broadcast(buf, 0, group=group.host_group)
    return buf


def broadcast_device(
    t: torch.Tensor | None, numel: int, dtype: torch.dtype, group: ParallelGroup
) -> torch.Tensor:
    """Rank 0's flat tensor on its device to every rank's device, over the model's group (on a
    GPU: queued on the current stream, after the work that computes it)."""
    if group.rank == 0:
        assert t is not None
        buf = t.contiguous()
    else:
        buf = torch.empty(numel, dtype=dtype, device=group.comm_device)
    if numel:
        dist.broadcast(buf, 0, group=group.group)
    return buf


def broadcast_bytes(data: bytes | None, group: ParallelGroup) -> bytes:
    (n,) = broadcast_ints([len(data)] if data is not None else None, 1, group)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == 0 and n else None
    if group.rank == 0 and not n:
        src = torch.empty(0, dtype=torch.uint8)
    return bytes(broadcast_host(src, n, torch.uint8, group).numpy())


def gather_bytes(data: bytes, group: ParallelGroup) -> list[bytes]:
    """Every rank's bytes, on every rank (rank order), over the host group."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.zeros_like(n) for _ in range(group.size)]
    dist.all_gather(lens, n, group=group.host_group)
    sizes = [int(x.item()) for x in lens]
    width = max(sizes) or 1
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(parts, mine, group=group.host_group)
    return [bytes(p[:s].numpy()) for p, s in zip(parts, sizes, strict=True)]


def all_reduce_min(value: int, group: ParallelGroup) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=group.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.group)
    return int(t.item())


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
