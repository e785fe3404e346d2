"""FP8 (e4m3) weights with per-output-channel scales: W8A8 for the linear projections (dynamic
per-token activation scales; `pdmesh.kernels.fp8`), weight-only for the MoE experts (their
activations stay in the model's dtype; the grouped GEMM widens each fp8 tile as it loads it).

Weights are quantized as their rows are loaded from a bf16 / fp32 checkpoint, or copied as they
are from an FP8 one, whose `weight_scale` tensors then load into the scales (`rows.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pdmesh.engine.layers.quantization.base import LinearMethod
from pdmesh.engine.layers.quantization.rows import ScaleSource, store_rows
from pdmesh.kernels.fp8 import FP8_DTYPE, fp8_linear, fp8_silu_and_mul_linear

Loader = Callable[[nn.Parameter, Any, Any], None]


def _fp8_pair(weight: nn.Parameter, loader: Loader | None) -> tuple[nn.Parameter, nn.Parameter]:
    """(fp8 weight shaped as `weight`, float32 scales shaped as its rows), linked for store_rows;
    the weight keeps `loader`."""
    q = nn.Parameter(torch.zeros(weight.shape, dtype=FP8_DTYPE, device=weight.device), False)
    # float32 whatever the model's dtype (the default dtype while the model is built).
    scale = nn.Parameter(
        torch.ones(weight.shape[:-1], dtype=torch.float32, device=weight.device), False
    )
    q.fp8_scale = scale
    scale.is_fp8_scale = True  # dummy weights: made with their weight, not drawn
    if loader is not None:
        q.weight_loader = loader
    return q, scale


def _scale_loader(place: Loader | None) -> Loader:
    """A loader for a checkpoint's weight_scale that places it as `place` (the weight's loader)
    places the weight's rows; None: the scale is whole (a replicated layer)."""

    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if isinstance(shard_id, tuple) and shard_id[0] is None:
            raise ValueError(
                f"{getattr(loaded, 'name', 'weight_scale')}: FP8 scales of experts stacked in "
                "one tensor are not supported; use a checkpoint with per-expert tensors"
            )
        src = ScaleSource(loaded, param.shape[-1])
        if place is None:
            store_rows(param, 0, src.load())
        else:
            place(param, src, shard_id)

    return load


class Fp8Linear(LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        loader = getattr(layer.weight, "weight_loader", None)
        layer.weight, layer.weight_scale = _fp8_pair(layer.weight, loader)
        layer.weight_scale.weight_loader = _scale_loader(loader)
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_silu_and_mul_linear(x, layer.weight, layer.weight_scale, bias)


def fp8_experts(moe: nn.Module) -> None:
    """An MoE block's stacked experts (w13 [E, 2I, H], w2 [E, H, I]) as fp8 with scales
    [E, 2I] and [E, H], which FusedMoE hands to the expert kernel."""
    for name in ("w13_weight", "w2_weight"):
        q, scale = _fp8_pair(getattr(moe, name), moe.weight_loader)
        scale.weight_loader = _scale_loader(moe.weight_loader)
        setattr(moe, name, q)
        setattr(moe, name + "_scale", scale)
