"""A one-shot all-reduce over symmetric memory, for the small all-reduces of decode steps.

With tensor parallelism a decode step of a small batch does two all-reduces per layer of a few
KiB each: NCCL's latency per call and its launch from Python dominate the step. Symmetric memory
(torch.distributed._symmetric_memory) maps one buffer of every rank into every other's address
space over NVLink; the one-shot kernel has each rank read all the others' copies and sum them,
with no NCCL and no host involvement, so decode steps can be captured in CUDA graphs on every
rank. Tensors that do not fit the buffer (prefill steps) or have another dtype go through NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pdmesh.logger import get_logger

log = get_logger(__name__)


class SymmetricAllReduce:
    def __init__(self, group: Any, device: torch.device, max_numel: int, dtype: torch.dtype):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, as a new tensor of x's shape."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view_as(x)


def symmetric_all_reduce(
    group: Any, device: torch.device, max_numel: int, dtype: torch.dtype
) -> SymmetricAllReduce | None:
    """The fast path if this build and these devices support it, else None (NCCL it is)."""
    if device.type != "cuda" or not dist.is_available():
        return None
    try:
        return SymmetricAllReduce(group, device, max_numel, dtype)
    except Exception as e:  # no NVLink P2P, an older torch, a CPU-only build
        log.warning("symmetric-memory all-reduce unavailable (%s); decode steps stay eager", e)
        return None
