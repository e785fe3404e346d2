"""Mixtral: the Llama decoder with a sparse MoE block (softmax top-k, renormalised)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from pdmesh.engine.layers.moe import FusedMoE
from pdmesh.engine.models.llama import LlamaForCausalLM
from pdmesh.engine.models.registry import register_model
from pdmesh.engine.parallel.group import ParallelGroup


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}
    expert_parts: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": "down"}

    def make_mlp(self, config: Any, layer_idx: int, tp: ParallelGroup) -> nn.Module:
        return FusedMoE(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            tp=tp,
        )
