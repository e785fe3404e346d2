"""All-reduces over symmetric memory for decode steps: one-shot when small, two-shot when large.

With tensor parallelism a decode step of a small batch does two all-reduces per layer of a few
KiB each: NCCL's latency per call and its launch from Python dominate the step. Symmetric memory
(torch.distributed._symmetric_memory) maps one buffer of every rank into every other's address
space over NVLink; the one-shot kernel has each rank read all the others' copies and sum them,
with no NCCL and no host involvement, so decode steps can be captured in CUDA graphs on every
rank. Tensors that do not fit the buffer (prefill steps) or have another dtype go through NCCL.
Where the build has it, the kernel copies its input into the shared buffer itself
(`one_shot_all_reduce_copy`): one kernel per all-reduce instead of a copy and then the reduce.
From 1 MiB on (PDMESH_TWO_SHOT_BYTES) the two-shot kernel takes over: each rank sums one share
and gathers the others', half the one-shot's reads of peer memory, faster for the hidden states
of large decode batches. PDMESH_ALL_REDUCE picks the way (pdmesh/envs.py).

The buffer is registered under a name of its own, made by rank 0 for each engine, not under the
process group's name: torch keeps a name's symmetric-memory store for the life of the process,
and group names start again from "0" after `destroy_process_group`, so a second engine in the
same process would rendezvous through the first one's closed store and hang. The tensor-parallel
group is registered under that name too: the rendezvous and the kernels look the group up by it.
"""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from pdmesh import envs
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.logger import get_logger

log = get_logger(__name__)


NAME_KEY = "pdmesh/symmetric-memory-name"


class SymmetricAllReduce:
    def __init__(
        self, tp: ParallelGroup, max_numel: int, dtype: torch.dtype, copy_in_kernel: bool = True
    ):
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory
        from torch.distributed import _symmetric_memory as symm_mem

        if tp.rank == 0:
            tp.store.set(NAME_KEY, f"pdmesh-{secrets.token_hex(8)}")
        self.group_name = tp.store.get(NAME_KEY).decode()
        _register_process_group(self.group_name, tp.group)
        _SymmetricMemory.set_group_info(
            self.group_name, tp.rank, tp.size, dist.PrefixStore(self.group_name, tp.store)
        )
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=tp.device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        # From this size on the two-shot kernel (envs.two_shot_bytes): on two H100s, 4096-wide
        # bf16 rows in CUDA graphs (bench/all_reduce_gpu.py), one-shot / two-shot (with its copy
        # in) took 8.8 / 9.1 µs at 1 row, 13.6 / 11.7 at 64, 17.0 / 14.0 at 128 (1 MiB), 24.0 /
        # 16.6 at 256 and 37.0 / 24.1 at 512.
        self.two_shot_bytes = envs.two_shot_bytes()
        self.copy_in_kernel = copy_in_kernel and hasattr(
            torch.ops.symm_mem, "one_shot_all_reduce_copy"
        )

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, as a new tensor of x's shape or in x itself."""
        shared = self.buffer[: x.numel()]  # the kernels want the buffer's and x's sizes equal
        if self.copy_in_kernel and x.numel() * x.element_size() >= self.two_shot_bytes:
            # Each rank sums one share of the buffer and then gathers the others' shares: half
            # the one-shot's reads of peer memory. The result lands in the shared buffer, which
            # the next all-reduce overwrites, so it is copied back into x.
            shared.copy_(x.reshape(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.group_name)
            return x.copy_(shared.view_as(x))
        if self.copy_in_kernel:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(
                shared, x.reshape(-1), "sum", self.group_name
            ).view_as(x)
        shared.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(shared, "sum", self.group_name).view_as(x)


def symmetric_all_reduce(
    tp: ParallelGroup, max_numel: int, dtype: torch.dtype
) -> SymmetricAllReduce | None:
    """The fast path if this build and these devices support it, else None (NCCL it is)."""
    mode = envs.all_reduce()
    if tp.device.type != "cuda" or not dist.is_available() or mode == "nccl":
        return None
    try:
        return SymmetricAllReduce(tp, max_numel, dtype, copy_in_kernel=mode == "auto")
    except Exception as e:  # no NVLink P2P, an older torch, a CPU-only build
        log.warning("symmetric-memory all-reduce unavailable (%s); decode steps stay eager", e)
        return None
