"""The process group a model's layers are split over (tensor / expert parallelism).

Layers receive a `ParallelGroup` when built; they never look up global state. Size 1 is the
plain single-process case and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total` (raises if it does not divide)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the parallel size {self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelGroup()
