"""Rotary embeddings built from a Hugging Face config (default, linear, llama3 and yarn RoPE)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# RoPE types whose frequencies do not depend on the sequence being run.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config, in transformers 5's `rope_parameters` form."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim / 2] float32 on the CPU: theta ** (-2i / rotary_dim), as transformers."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (theta**exps)


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of the default frequencies ([rotary_dim / 2], float32): waves
    longer than the original context / low_freq_factor slow down by `factor`, those shorter
    than original context / high_freq_factor stay, and the band between blends the two. The
    float32 operations are transformers' own, in its order, so the tables are equal bit for bit
    (tests/test_hf_config.py)."""
    factor, low, high, context = (params[k] for k in LLAMA3_KEYS)
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    between = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(between, blended, slowed)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of a model's rotary embedding ([max_position, rotary_dim]: cos halves
    then sin halves, float32). Attention applies it with the KV store (layers/attention.py's
    QKPrologue, kernels/prologue.py)."""

    def __init__(self, config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE)}"
            )
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        # Computed on the CPU (transformers' RoPE helpers return CPU tensors), then moved to the
        # device the model is being built on.
        target = torch.empty(0).device
        cpu = torch.device("cpu")
        if rope_type in ("default", "llama3"):  # llama3 without transformers (hf_config.py)
            inv_freq, scaling = default_inv_freq(params["rope_theta"], rotary_dim), 1.0
            if rope_type == "llama3":
                inv_freq = llama3_inv_freq(inv_freq, params)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu)
        # Same float32 arithmetic as transformers: position * inv_freq, then cos/sin, then scaling.
        positions = torch.arange(max_position, dtype=torch.int64, device=cpu).float()
        freqs = positions[:, None] * inv_freq.to(cpu)[None, :]
        cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(target)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_pos, rotary_dim]
