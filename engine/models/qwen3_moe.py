"""Qwen3-MoE: the Qwen3 decoder with sparse MoE blocks (dense MLPs on `mlp_only_layers`)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from pdmesh.engine.layers.moe import FusedMoE
from pdmesh.engine.models.llama import GatedMLP, Qwen3ForCausalLM
from pdmesh.engine.models.registry import register_model
from pdmesh.engine.parallel.group import ParallelGroup


def num_experts_of(config: Any) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_parts: ClassVar[dict[str, str]] = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    }

    def make_mlp(self, config: Any, layer_idx: int, tp: ParallelGroup) -> nn.Module:
        sparse = (
            layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )
        if not sparse:
            return GatedMLP(config.hidden_size, config.intermediate_size, False, tp)
        return FusedMoE(
            num_experts=num_experts_of(config),
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            tp=tp,
        )
