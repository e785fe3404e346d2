"""Logical experts -> physical slots of one MoE layer under expert parallelism.

Without EPLB slot e holds expert e. With EPLB (pdmesh.engine.eplb.placement) an expert may have
replicas in several slots; a token's pair goes to replica (token index % replicas), so a hot
expert's tokens are split evenly and deterministically (the same batch always dispatches the same
way). The tables are buffers updated in place: a placement change keeps every tensor's address.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pdmesh.kernels import SlotTable


class ExpertMap(nn.Module):
    def __init__(self, num_experts: int, num_physical: int, num_ranks: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_physical = num_physical
        self.per_rank = num_physical // num_ranks
        # A table row per expert, wide enough for an expert in every slot.
        self.register_buffer("phy2log", torch.zeros(num_physical, dtype=torch.int64))  # [P]
        self.register_buffer("log2phy", torch.zeros(num_experts, num_physical, dtype=torch.int64))
        self.register_buffer("replicas", torch.ones(num_experts, dtype=torch.int64))  # [E]
        self.set(tuple(p % num_experts for p in range(num_physical)))

    def set(self, placement: Sequence[int]) -> None:
        """placement: [P] the logical expert of each slot."""
        log2phy = [[] for _ in range(self.num_experts)]  # type: list[list[int]]
        for slot, e in enumerate(placement):
            log2phy[e].append(slot)
        if any(not slots for slots in log2phy):
            raise ValueError(f"a placement must hold every expert, got {tuple(placement)}")
        table = torch.zeros_like(self.log2phy, device="cpu")
        for e, slots in enumerate(log2phy):
            table[e, : len(slots)] = torch.tensor(slots)
        self.phy2log.copy_(torch.tensor(list(placement)))
        self.log2phy.copy_(table)
        self.replicas.copy_(torch.tensor([len(s) for s in log2phy]))

    def placement(self) -> tuple[int, ...]:
        return tuple(self.phy2log.tolist())

    def table(self, first_token: int) -> SlotTable:
        """The tables routing reads to send the pairs of batch rows first_token.. to slots."""
        return SlotTable(self.log2phy, self.replicas, first_token)

    def local_experts(self, rank: int) -> list[int]:
        """The logical expert of each of `rank`'s slots."""
        return self.phy2log[rank * self.per_rank : (rank + 1) * self.per_rank].tolist()
