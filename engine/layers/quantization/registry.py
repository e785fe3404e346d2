"""Quantization methods by name (`EngineConfig.quantization`), and applying one to a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from pdmesh.engine.layers.linear import ReplicatedLinear, _ShardedLinear
from pdmesh.engine.layers.moe import FusedMoE
from pdmesh.engine.layers.quantization.base import LinearMethod
from pdmesh.engine.layers.quantization.checkpoint import checkpoint_quantization
from pdmesh.engine.layers.quantization.fp8 import Fp8Linear, fp8_experts


@dataclass(frozen=True)
class QuantizationMethod:
    linear: LinearMethod  # the projections (q/k/v, o, gate/up, down; replicated linears)
    experts: Callable[[nn.Module], None]  # an MoE block's stacked expert weights


QUANTIZATIONS: dict[str, QuantizationMethod] = {
    "fp8": QuantizationMethod(Fp8Linear(), fp8_experts),
}


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The method a model runs with: the one asked for, or the checkpoint's (an FP8 checkpoint
    runs FP8 unasked, as in vLLM). ValueError when they disagree or the name is unknown."""
    stored = checkpoint_quantization(hf_config)
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, got {requested!r}."
        )
    if stored is not None and requested not in (None, stored):
        raise ValueError(f"quantization={requested!r}, but the checkpoint is {stored}-quantized.")
    return requested or stored


def apply_quantization(model: nn.Module, name: str | None) -> None:
    """Swap the weights of `model`'s linear layers and MoE experts for method `name`'s (None:
    nothing), before the weights are loaded. MoE routers stay in the model's dtype: their logits
    pick the experts, and they are a sliver of the bytes."""
    if name is None:
        return
    method = QUANTIZATIONS[name]
    routers = {id(m.gate) for m in model.modules() if isinstance(m, FusedMoE)}
    for module in list(model.modules()):
        if isinstance(module, FusedMoE):
            method.experts(module)
        elif isinstance(module, ReplicatedLinear | _ShardedLinear) and id(module) not in routers:
            method.linear.create_weights(module)
