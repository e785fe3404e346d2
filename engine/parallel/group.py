"""The process group a model's layers are split over (tensor / expert parallelism).

Layers receive a `ParallelGroup` when built; they never look up global state. Size 1 is the
plain single-process case and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    # A gloo group over the same ranks for what rank 0 tells its followers (step inputs,
    # control messages): host integers that must never wait behind the device's queued work.
    host_group: Any = None
    # The ranks' rendezvous store (a torch.distributed Store): symmetric memory registers there.
    store: Any = None
    # MoE layers split experts over the group (and tokens for the all-to-all) instead of
    # splitting every expert's intermediate dimension.
    expert_parallel: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Collectives that ran through all_to_all (the EP path), for tests and stats.
    counters: dict[str, int] = field(default_factory=lambda: {"all_to_all": 0}, compare=False)
    # The symmetric-memory all-reduce for small tensors (set by the model runner on GPUs).
    fast: dict[str, Any] = field(default_factory=dict, compare=False)
    # EPLB: physical expert slots beyond the model's experts, spread over the group's ranks.
    redundant_experts: int = 0
    # Expert parallelism's exchange (set by the model runner): True, each rank computes its
    # experts' pairs for every token and one all-reduce sums the ranks' parts; False, the tokens
    # are split over the ranks and dispatched and combined with all_to_all.
    moe_all_reduce: bool = False
    # Data-parallel attention (engine/data_parallel/): the group MoE layers split their experts
    # over when it is not this one: every rank of the data-parallel world, each with tokens of
    # its own requests (None: MoE layers use this group).
    moe: ParallelGroup | None = None
    # On that MoE group: the ranks' tokens differ (each its own batch). `step_tokens`: [the
    # most tokens any rank runs this step (0: as many as this rank's own, the case in a CUDA
    # graph's capture and replay, where every rank runs the same bucket), the padding rows at
    # the end of this rank's own (an idle rank's step), which the expert counts leave out].
    data_parallel: bool = False
    step_tokens: list[int] = field(default_factory=lambda: [0, 0], compare=False)

    @property
    def moe_group(self) -> ParallelGroup:
        """The group MoE layers split experts (or their intermediate dimension) over."""
        return self.moe if self.moe is not None else self

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
        return self.device

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total` (raises if it does not divide)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the parallel size {self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group (callers use the result: it may be a new tensor)."""
        if self.size > 1:
            fast = self.fast.get("all_reduce")
            if fast is not None and fast.fits(x):
                return fast(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        if dim == 0:  # straight into one buffer: no list of parts, no concatenation
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[N * n, ...] summed over the ranks, this rank's n rows (rank order)."""
        if self.size == 1:
            return x
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows of `x` split by `send_counts` go to ranks 0..N-1; returns the rows received."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        self.counters["all_to_all"] += 1
        return out


SINGLE = ParallelGroup()
