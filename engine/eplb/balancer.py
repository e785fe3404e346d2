"""EPLB on every rank: count each step's expert load, re-place the experts every few steps.

The model runner calls `after_step` on every rank after each forward (rank 0 in `launch`,
followers in `follow_step`). Every rank runs every step, so every rank reaches the same step
count at the same boundary; there each all-reduces its window of counts over the
expert-parallel group (each rank routed only its slice of the tokens), computes the same
placement from the same sums (pdmesh.engine.eplb.placement is deterministic), and moves the weights
(`move_experts`) before the next step. No message from rank 0 is needed to agree.

Counts stay on the device between rebalances (one row per step in a ring); the host reads
them only at a rebalance, or when asked for figures (`counts`, between steps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdmesh.engine.eplb.placement import Placement, imbalance, moved_slots, rebalance
from pdmesh.engine.layers.expert_move import move_experts
from pdmesh.engine.layers.moe import FusedMoE
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.kv_transfer.connector import control_message


@control_message
class CountEplb:
    """Asks a follower for its EPLB counters (`EplbCounts`)."""


@control_message
class EplbCounts:
    """One rank's pairs dispatched to each physical slot: [L * P] since the last rebalance and
    [P] since start (summed over layers)."""

    since_rebalance: tuple[int, ...]
    total: tuple[int, ...]


@dataclass(frozen=True)
class EplbStats:
    """The worker's EPLB figures, over every rank."""

    rebalances: int  # placements recomputed and applied
    experts_moved: int  # physical slots that changed expert, over rebalances and layers
    # [P] tokens sent to each physical slot since start, summed over MoE layers (slot p is on
    # rank p // (P / N)).
    physical_expert_tokens: tuple[int, ...]
    imbalance: float  # max / mean tokens per rank since the last rebalance (1.0: balanced)
    imbalance_history: tuple[float, ...]  # the same, for each placement replaced, oldest first
    placement: Placement  # [L][P] the logical expert in each physical slot now
    rebalance_seconds: float  # this rank's wall time in rebalances (counts, placement, moves)


class ExpertBalancer:
    def __init__(
        self, layers: Sequence[FusedMoE], window: int, interval: int, group: ParallelGroup
    ) -> None:
        if not layers or any(m.experts is None for m in layers):
            raise ValueError("EPLB needs expert-parallel MoE layers")
        self.layers = list(layers)
        self.group = group
        self.interval = interval
        experts = self.layers[0].experts
        assert experts is not None
        self.num_experts, self.num_physical = experts.num_experts, experts.num_physical
        device = self.layers[0].expert_counts.device
        # [W, L, E]: this rank's tokens per logical expert, one row per step (a ring).
        self._window = torch.zeros(
            window, len(self.layers), self.num_experts, dtype=torch.int64, device=device
        )
        self._seen = self._logical()  # [L, E] the counters after the last step
        self._epoch_start = self._physical()  # [L, P] the counters at the last rebalance
        self.steps = 0
        self.rebalances = 0
        self.experts_moved = 0
        self.history: list[float] = []
        self.seconds = 0.0
        # The figures over every rank as of the last rebalance, its imbalance that of the
        # placement it replaced: what a metrics scrape reads, off the engine thread.
        self.published = self.stats([self.counts()])

    def _logical(self) -> torch.Tensor:
        return torch.stack([m.expert_counts for m in self.layers])

    def _physical(self) -> torch.Tensor:
        return torch.stack([m.physical_counts for m in self.layers])

    def placement(self) -> Placement:
        return tuple(m.experts.placement() for m in self.layers if m.experts is not None)

    def after_step(self) -> None:
        """Between steps, on every rank: count the step; rebalance every `interval` steps."""
        now = self._logical()
        self._window[self.steps % self._window.shape[0]] = now - self._seen
        self._seen = now
        self.steps += 1
        if self.steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        start = time.perf_counter()
        try:
            self._rebalance()
        finally:
            self.seconds += time.perf_counter() - start

    def _rebalance(self) -> None:
        layers, experts, physical = len(self.layers), self.num_experts, self.num_physical
        epoch = self._physical() - self._epoch_start  # [L, P]
        total = self._physical().sum(0)  # [P]
        mine = torch.cat((self._window.sum(0).flatten(), epoch.flatten(), total))
        summed = self.group.all_reduce(mine.to(self.group.comm_device)).tolist()
        load = [summed[i * experts : (i + 1) * experts] for i in range(layers)]
        if not any(map(any, load)):
            return  # nothing routed in the window: keep the placement
        at = layers * experts
        epoch_tokens = [summed[at + i * physical : at + (i + 1) * physical] for i in range(layers)]
        old = self.placement()
        new = rebalance(load, old, self.group.size)
        for moe, placement in zip(self.layers, new, strict=True):
            move_experts(moe, placement)
        self.history.append(imbalance(epoch_tokens, self.group.size))
        self.rebalances += 1
        self.experts_moved += moved_slots(old, new)
        self._epoch_start = self._physical()
        self.published = EplbStats(
            self.rebalances,
            self.experts_moved,
            tuple(summed[at + layers * physical :]),
            self.history[-1],
            tuple(self.history),
            new,
            self.seconds,
        )

    def counts(self) -> EplbCounts:
        """This rank's counters (the reply to `CountEplb`)."""
        epoch = self._physical() - self._epoch_start
        return EplbCounts(tuple(epoch.flatten().tolist()), tuple(self._physical().sum(0).tolist()))

    def stats(self, ranks: Sequence[EplbCounts]) -> EplbStats:
        """The figures from every rank's counts (rank 0's first)."""
        epoch = [sum(c) for c in zip(*(r.since_rebalance for r in ranks), strict=True)]
        total = [sum(c) for c in zip(*(r.total for r in ranks), strict=True)]
        p = self.num_physical
        per_layer = [epoch[i * p : (i + 1) * p] for i in range(len(self.layers))]
        return EplbStats(
            self.rebalances,
            self.experts_moved,
            tuple(total),
            imbalance(per_layer, self.group.size),
            tuple(self.history),
            self.placement(),
            self.seconds,
        )
