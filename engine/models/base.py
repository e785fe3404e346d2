"""What every causal LM here shares: the forward contract and checkpoint-name mapping."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from pdmesh.engine.layers.attention import AttentionMetadata

# Per-expert checkpoint matrices: "...experts.3.w1.weight", "...experts.3.gate_proj.weight".
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
# Experts stacked over the expert dimension (transformers 5): "...experts.gate_up_proj".
_STACKED_RE = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta) -> hidden [T, H] (its decoder: `self.model`);
    compute_logits(hidden [S, H]) -> [S, V].

    Subclasses declare how checkpoint names map onto their parameters:
    `packed_modules_mapping` (q/k/v into qkv, gate/up into gate_up), `checkpoint_renames`
    (module names that differ from the checkpoint's) and `expert_parts` (per-expert matrix name
    -> "gate" | "up" | "down").
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    expert_parts: ClassVar[dict[str, str]] = {}
    tie_word_embeddings: bool = False

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        if "rotary_emb.inv_freq" in name or name.endswith((".input_scale", ".weight_zero_point")):
            return None  # FP8 checkpoints' static activation scales: activations scale per token
        if name.endswith(".weight_scale"):  # an FP8 weight's scales go where its rows go
            target = self.map_checkpoint_name(name.removesuffix("_scale"))
            return None if target is None else (target[0] + "_scale", target[1])
        if self.tie_word_embeddings and name.startswith("lm_head."):
            return None
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        if m := _EXPERT_RE.search(name):
            part = self.expert_parts.get(m.group(2))
            if part is None:
                return None
            target = "w2_weight" if part == "down" else "w13_weight"
            return name[: m.start()] + "." + target, (int(m.group(1)), part)
        if m := _STACKED_RE.search(name):
            target = "w13_weight" if m.group(1) == "gate_up_proj" else "w2_weight"
            part = "gate_up" if m.group(1) == "gate_up_proj" else "down"
            return name[: m.start()] + "." + target, (None, part)
        for ckpt_name, (param_name, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_name}." in name:
                return name.replace(f".{ckpt_name}.", f".{param_name}."), shard_id
        return name, None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        carry: Tensor | None = None,
    ) -> Tensor:
        """The decoder's hidden states; with pipeline parallelism see `DecoderModel.forward`."""
        return self.model(input_ids, positions, meta, carry)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        from pdmesh.engine.layers.attention import Attention

        return [m for m in self.modules() if isinstance(m, Attention)]
