"""A sparse MoE block: a replicated router and SwiGLU experts stacked in two tensors.

Without expert parallelism every rank holds every expert, with the expert MLPs' intermediate
dimension split across the tensor-parallel group (partial sums all-reduced). With expert
parallelism each rank holds E / N whole experts, and the ranks exchange in one of two ways
(`ParallelGroup.moe_all_reduce`; the model runner picks all_reduce on GPUs, all_to_all on CPUs):

- all_to_all: the tokens (the same on every rank) are split across ranks, each (token, expert)
  pair is sent with all-to-all to the rank holding its expert, computed there, sent back with
  all-to-all, combined, and the token slices all-gathered. The exchange's sizes are read on the
  host (a sync per layer), so such steps run eagerly.
- all_reduce: every rank already holds every token (attention is tensor-parallel), so each routes
  them all, computes the pairs whose experts it holds, and one all-reduce of [T, H] sums the
  ranks' parts: 1/k of the bytes the dispatch and combine move for top-k routing, no host sync,
  and decode steps replay CUDA graphs. (vLLM's allgather-reducescatter, the gather being free.)

With EPLB (pdmesh.engine.eplb.placement) the E experts live in E + R physical slots, (E + R) / N on
each rank, a hot expert in several; `ExpertMap` sends each pair to one of its expert's slots, and
the balancer moves weights between slots between steps (`engine/layers/expert_move.py`), in place,
so that decode graphs captured before a move stay valid. Either exchange serves it; only the
all-to-all sums each token's experts in the same order whatever the placement (bit-identical
outputs with EPLB on and off, as on CPUs).

With data-parallel attention (engine/data_parallel/) each rank holds tokens of its own requests,
and the MoE layers' group is the whole data-parallel world (`ParallelGroup.moe`). The ranks then
exchange in one of two ways:

- all_to_all, as above without the split and the gather: each rank dispatches its own tokens.
- gather_scatter (`moe_all_reduce` on that group; vLLM's allgather-reducescatter): the ranks'
  tokens, padded to the step's most on any rank, are all-gathered, each rank computes its
  experts' pairs for all of them, and a reduce-scatter hands each rank the sums for its own
  rows. No host sync: decode steps replay CUDA graphs (every rank the same bucket). Padding
  rows (those storing no KV, which the model runner notes) travel flagged, and no rank computes
  their experts.
"""

from __future__ import annotations

import torch
from torch import nn

from pdmesh.engine.layers.expert_map import ExpertMap
from pdmesh.engine.layers.linear import ReplicatedLinear
from pdmesh.engine.layers.quantization.rows import store_rows
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.weights import CheckpointTensor
from pdmesh.kernels import RouteTally, moe_experts, moe_route


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
        tp = tp.moe_group
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp = tp
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        self.experts: ExpertMap | None = None
        if self.expert_parallel:
            num_physical = num_experts + tp.redundant_experts
            if num_physical % tp.size:
                valid = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
                raise ValueError(
                    f"expert parallelism over {tp.size} ranks needs the {num_physical} experts to "
                    f"divide evenly; valid sizes: {', '.join(map(str, valid))}."
                )
            self.inter_local = intermediate_size
            self.num_local_experts = num_physical // tp.size
            self.first_expert = tp.rank * self.num_local_experts  # this rank's first slot
            self.experts = ExpertMap(num_experts, num_physical, tp.size)
            # Pairs this rank dispatched to each physical slot since start (EPLB's figures).
            self.register_buffer("physical_counts", torch.zeros(num_physical, dtype=torch.int64))
        else:
            self.inter_local = tp.shard(intermediate_size, "MoE intermediate size")
            self.num_local_experts = num_experts
            self.first_expert = 0
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        e, i, h = self.num_local_experts, self.inter_local, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)  # [E, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)  # [E, H, I]
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Per-row scales [E, 2I] and [E, H] where a quantization method made the experts fp8.
        self.register_parameter("w13_weight_scale", None)
        self.register_parameter("w2_weight_scale", None)
        # Tokens routed to each expert since start (for load statistics / rebalancing).
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64))

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int | None, str]
    ) -> None:
        """shard_id: (expert, part) for per-expert matrices, (None, part) for tensors stacked
        over experts as transformers 5 stores them ("gate_up" [E, 2I, H], "down" [E, H, I])."""
        expert, part = shard_id
        # Under expert parallelism whole experts are held, so the intermediate dim is not split.
        rank = 0 if self.expert_parallel else self.tp.rank
        held = (
            self.experts.local_experts(self.tp.rank)
            if self.experts is not None
            else list(range(self.num_experts))
        )
        for slot, e in enumerate(held):
            if expert is None:
                self._load_slot(param, slot, part, loaded.narrow(0, e, 1)[0], rank)
            elif e == expert:
                self._load_slot(param, slot, part, loaded, rank)

    def _load_slot(
        self, param: nn.Parameter, slot: int, part: str, w: CheckpointTensor, rank: int
    ) -> None:
        """One expert's `part` into slot `slot` of `param`: w is gate_up [2I, H], gate / up
        [I, H] or down [H, I] (a CheckpointTensor or a tensor: both narrow); `rank`'s share of I
        is taken. Rows are written with store_rows (quantized where the experts are fp8)."""
        i = self.inter_local
        if part == "down":
            store_rows(param, 0, w.narrow(1, rank * i, i), slot)
        elif part == "gate_up":
            full_i = w.shape[0] // 2
            store_rows(param, 0, w.narrow(0, rank * i, i), slot)
            store_rows(param, i, w.narrow(0, full_i + rank * i, i), slot)
        else:
            store_rows(param, 0 if part == "gate" else i, w.narrow(0, rank * i, i), slot)

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The experts' fp8 scales (w13's, w2's), or (None, None) for unquantized experts."""
        return self.w13_weight_scale, self.w2_weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        if self.experts is not None:
            if self.tp.data_parallel:
                if self.tp.moe_all_reduce:
                    return self._forward_gather_scatter(x, self.experts)
                return self._forward_expert_parallel(x, self.experts, split=False)
            if self.tp.moe_all_reduce:
                return self._forward_all_reduce(x, self.experts)
            return self._forward_expert_parallel(x, self.experts)
        tally = RouteTally(0, x.shape[0], self.expert_counts)
        r = moe_route(self.gate(x), self.top_k, self.renormalize, tally=tally)
        w13, w2, first = self.w13_weight, self.w2_weight, self.first_expert
        out = moe_experts(x, w13, w2, r.weights, r.ids, first, *self._scales())
        return self.tp.all_reduce(out)

    def _forward_all_reduce(self, x: torch.Tensor, experts: ExpertMap) -> torch.Tensor:
        # x: [T, H], the same on every rank -> [T, H]
        g, num_tokens = self.tp, x.shape[0]
        # Each rank counts its own slice of the tokens, so the counts summed over the ranks
        # count every pair once (as with all_to_all).
        per_rank = -(-num_tokens // g.size)
        lo, hi = min(g.rank * per_rank, num_tokens), min((g.rank + 1) * per_rank, num_tokens)
        tally = RouteTally(lo, hi, self.expert_counts, self.physical_counts)
        r = moe_route(self.gate(x), self.top_k, self.renormalize, experts.table(0), tally)
        # Pairs of experts held elsewhere are skipped (they count zero here).
        w13, w2, first = self.w13_weight, self.w2_weight, self.first_expert
        out = moe_experts(x, w13, w2, r.weights, r.slots, first, *self._scales())
        return g.all_reduce(out)

    def _forward_gather_scatter(self, x: torch.Tensor, experts: ExpertMap) -> torch.Tensor:
        # x: [t, H], this rank's own tokens -> [t, H]
        g, (t, hidden) = self.tp, x.shape
        width = max(g.step_tokens[0], t)  # the step's most tokens on any rank
        # Padding rows (an idle rank's, a graph bucket's beyond its batch: those that store no
        # KV, as the model runner notes in `fast["slots"]`) go out flagged in one more column,
        # and no rank computes their experts: at batch 1 an idle peer's padding row would
        # otherwise double the experts each rank reads.
        slots_now = g.fast.get("slots")
        flagged = slots_now is not None  # on every rank or none: the column is gathered
        if flagged:
            if slots_now.shape[0] != t:
                raise RuntimeError(f"the runner noted {slots_now.shape[0]} rows, the layer has {t}")
            valid = (slots_now >= 0).to(x.dtype).unsqueeze(1)  # [t, 1]
            x = torch.cat((x, valid), dim=1)  # [t, H + 1]
        if width > t:
            x = torch.cat((x, x.new_zeros(width - t, x.shape[1])))  # flagged as padding
        everyone = g.all_gather(x, dim=0)  # [N * width, H (+ 1)], rank r's rows at r * width
        if flagged:
            keep = everyone[:, hidden] > 0  # [N * width]
            everyone = everyone[:, :hidden].contiguous()
        # Count this rank's own pairs (padding rows route too).
        lo, real = g.rank * width, t - g.step_tokens[1]
        tally = RouteTally(lo, lo + real, self.expert_counts, self.physical_counts)
        r = moe_route(self.gate(everyone), self.top_k, self.renormalize, experts.table(0), tally)
        slots = r.slots
        if flagged:  # slot -1 is held nowhere: the kernels skip the pair
            slots = torch.where(keep.unsqueeze(1), slots, -1)
        w13, w2, first = self.w13_weight, self.w2_weight, self.first_expert
        out = moe_experts(everyone, w13, w2, r.weights, slots, first, *self._scales())
        return g.reduce_scatter(out)[:t]

    def _forward_expert_parallel(
        self, x: torch.Tensor, experts: ExpertMap, split: bool = True
    ) -> torch.Tensor:
        """split: x is the same on every rank, which takes a slice of it and all-gathers the
        results; else (data-parallel attention) x is this rank's own tokens."""
        g = self.tp
        num_tokens, hidden = x.shape
        per_rank = -(-num_tokens // g.size) if split else num_tokens
        lo = min(g.rank * per_rank, num_tokens) if split else 0
        mine = x[lo : min(lo + per_rank, num_tokens)]  # [t, H]: this rank's slice of the tokens
        t, k = mine.shape[0], self.top_k
        real = t if split else t - g.step_tokens[1]  # an idle rank's padding is not counted
        tally = RouteTally(0, real, self.expert_counts, self.physical_counts)
        r = moe_route(self.gate(mine), k, self.renormalize, experts.table(lo), tally)  # [t, k]
        weights, ids = r.weights, r.ids
        # Pairs (token, slot) sorted by the rank that holds their expert's physical slot.
        pair_ids = r.slots.flatten()  # [t * k]
        dest = torch.div(pair_ids, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=g.size)
        recv_counts = g.all_to_all(send_counts, [1] * g.size, [1] * g.size)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        tokens = torch.arange(t, device=x.device).repeat_interleave(k)[order]
        meta = torch.stack((pair_ids[order].float(), weights.flatten()[order].float()), dim=1)
        recv_x = g.all_to_all(mine[tokens], send, recv)  # [R, H]
        recv_meta = g.all_to_all(meta, send, recv)  # [R, 2]: physical slot, routing weight
        # Each received row is one pair: weight * expert(x) for an expert held here.
        e_w, e_ids = recv_meta[:, 1:2], recv_meta[:, 0:1].long()
        w13, w2, first = self.w13_weight, self.w2_weight, self.first_expert
        done = moe_experts(recv_x, w13, w2, e_w, e_ids, first, *self._scales())
        back = g.all_to_all(done, recv, send)  # [t * k, H] in `order`
        contrib = torch.empty_like(back)
        contrib[order] = back
        # Sum each token's experts in ascending (logical) expert order, as Hugging Face does.
        by_expert = ids.argsort(dim=1)
        contrib = contrib.view(t, k, hidden).gather(1, by_expert.unsqueeze(-1).expand(t, k, hidden))
        out_mine = x.new_zeros(per_rank, hidden)
        for j in range(k):
            out_mine[:t] += contrib[:, j]
        if not split:
            return out_mine
        return g.all_gather(out_mine, dim=0)[:num_tokens]
