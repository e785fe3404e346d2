"""Llama-style decoders: Llama (SmolLM2, Llama 3 with RoPE scaling), Qwen2 and Qwen3.

The variants differ only in projection biases and Qwen3's per-head q/k RMSNorm; each is a small
subclass stating its differences. MoE models reuse this decoder with another MLP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pdmesh.engine.layers.attention import Attention, AttentionMetadata, QKPrologue
from pdmesh.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pdmesh.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdmesh.engine.layers.norm import RMSNorm
from pdmesh.engine.layers.rotary import RotaryEmbedding
from pdmesh.engine.models.base import CausalLM
from pdmesh.engine.models.registry import register_model
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.parallel.pipeline import SINGLE_STAGE, PipelineStage


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        max_position: int,
        tp: ParallelGroup,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias, tp=tp
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_position)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) D]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Norms, rotary embedding and the KV store: one kernel on GPUs (kernels/prologue.py).
        norms = (None, None, 0.0)
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        prologue = QKPrologue(positions, self.rotary_emb.cos_sin_cache, *norms)
        return self.o_proj(self.attn(q, k, v, meta, prologue))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: ParallelGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, tp=tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage owns: no weights here."""


class DecoderModel(nn.Module):
    def __init__(
        self, config: Any, layers: list[nn.Module], tp: ParallelGroup, stage: PipelineStage
    ) -> None:
        super().__init__()
        self.own_layers = stage.layers if stage.layers is not None else range(len(layers))
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if stage.is_first
            else None
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, carry: Tensor | None
    ) -> Tensor:
        """hidden [T, H] after the final norm; on a stage before the last, [2, T, H] (hidden
        states and residual) for the next stage, which passes them in as `carry`."""
        if carry is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = carry[0], carry[1]
        for i in self.own_layers:
            hidden, residual = self.layers[i](positions, hidden, residual, meta)
        if self.norm is None:
            return torch.stack((hidden, residual))
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def __init__(
        self,
        config: Any,
        max_position: int,
        tp: ParallelGroup = SINGLE,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        qkv_bias, o_bias = self.projection_biases(config)
        layers = [
            DecoderLayer(
                config,
                SelfAttention(config, max_position, tp, qkv_bias, o_bias, self.qk_norm),
                self.make_mlp(config, i, tp),
            )
            if stage.owns(i)
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers, tp, stage)
        self.lm_head = None
        if stage.is_last:
            tie = self.model.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tie_to=tie)
            if self.tie_word_embeddings and tie is None:
                # The last stage of a pipeline holds the tied head without the embedding: it
                # loads the embedding's checkpoint tensor as its own weight.
                self.checkpoint_renames = {
                    **self.checkpoint_renames,
                    "model.embed_tokens.": "lm_head.",
                }

    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def make_mlp(self, config: Any, layer_idx: int, tp: ParallelGroup) -> nn.Module:
        bias = bool(getattr(config, "mlp_bias", False))
        return GatedMLP(config.hidden_size, config.intermediate_size, bias, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return True, False  # Qwen2 always biases q/k/v, never o


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
