"""A sparse MoE block: a replicated router and SwiGLU experts stacked in two tensors.

Without expert parallelism every rank holds every expert, with the expert MLPs' intermediate
dimension split across the tensor-parallel group (partial sums all-reduced).
"""

from __future__ import annotations

import torch
from torch import nn

from pdmesh.engine.layers.linear import ReplicatedLinear
from pdmesh.engine.parallel import SINGLE, ParallelGroup
from pdmesh.engine.weights import CheckpointTensor
from pdmesh.kernels import count_expert_tokens, moe_experts, moe_route

# Which stacked tensor and which half of it each per-expert checkpoint matrix fills.
EXPERT_PARTS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp = tp
        self.inter_local = tp.shard(intermediate_size, "MoE intermediate size")
        self.first_expert = 0
        self.num_local_experts = num_experts
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        e, i, h = self.num_local_experts, self.inter_local, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)  # [E, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)  # [E, H, I]
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Tokens routed to each expert since start (for load statistics / rebalancing).
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64))

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int | None, str]
    ) -> None:
        """shard_id: (expert, part) for per-expert matrices, (None, part) for tensors stacked
        over experts as transformers 5 stores them ("gate_up" [E, 2I, H], "down" [E, H, I])."""
        expert, part = shard_id
        i, rank = self.inter_local, self.tp.rank
        if expert is None:
            local = loaded.narrow(0, self.first_expert, self.num_local_experts)
            if part == "gate_up":
                full_i = local.shape[1] // 2
                param.data[:, :i].copy_(local[:, rank * i : (rank + 1) * i])
                param.data[:, i:].copy_(local[:, full_i + rank * i : full_i + (rank + 1) * i])
            else:
                param.data.copy_(local[:, :, rank * i : (rank + 1) * i])
            return
        e = expert - self.first_expert
        if not 0 <= e < self.num_local_experts:
            return
        if part == "down":
            param.data[e].copy_(loaded.narrow(1, rank * i, i))
        else:
            offset = 0 if part == "gate" else i
            param.data[e, offset : offset + i].copy_(loaded.narrow(0, rank * i, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = moe_route(self.gate(x), self.top_k, self.renormalize)
        self.expert_counts += count_expert_tokens(ids, self.num_experts)
        out = moe_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.first_expert)
        return self.tp.all_reduce(out)
