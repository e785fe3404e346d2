"""Writing checkpoint rows into a parameter that may be quantized.

Every weight loader of the linear and MoE layers ends in `store_rows`: a plain parameter gets the
rows copied; an FP8 one (a parameter with an `fp8_scale` attribute, its per-row scales) gets them
quantized per row as they arrive, or copied as they are when the checkpoint's rows are already
float8 (their scales then come as separate `weight_scale` tensors, loaded by `ScaleSource`).
Quantizing each shard's rows on arrival works because a row's scale depends on that row alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdmesh.kernels.fp8 import FP8_DTYPE, quantize_rows


def store_rows(param: nn.Parameter, offset: int, src: torch.Tensor, slot: int | None = None):
    """Rows [offset, offset + len(src)) of `param` (of its expert `slot`, for stacked expert
    weights) become `src` ([n, ...] matching those rows), quantized where `param` is FP8."""
    data = param.data if slot is None else param.data[slot]
    dst = data.narrow(0, offset, src.shape[0])
    scale = getattr(param, "fp8_scale", None)
    if src.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
        raise ValueError(
            f"an FP8 checkpoint tensor of shape {tuple(src.shape)} is loaded into a layer that "
            "is not quantized (its weight_scale would be ignored): pdmesh quantizes the linear "
            "projections and MoE experts only"
        )
    if scale is None or src.dtype == FP8_DTYPE:
        dst.copy_(src)
        if scale is not None:  # float8 rows: the checkpoint must hold their scales (load_named)
            param.fp8_rows_copied = True
        return
    k = src.shape[-1]
    q, s = quantize_rows(src.to(dst.device).reshape(-1, k))  # [rows, K] fp8, [rows]
    dst.copy_(q.view(src.shape))
    scales = scale.data if slot is None else scale.data[slot]
    scales.narrow(0, offset, src.shape[0]).copy_(s.view(src.shape[:-1]))


class ScaleSource:
    """A checkpoint's `weight_scale` tensor seen through the `CheckpointTensor` interface of its
    weight, so that the weight's own loader places it: rows narrowed as the weight's rows are.

    The scale has one value per output row ([N], [N, 1]: per channel) or one for the whole matrix
    ([], [1]: per tensor, repeated over the rows asked for). It has no input dimension, so a
    narrow along dim 1 (a row-parallel shard, an MoE down projection's share) is every row:
    `rows` of them, the parameter's."""

    def __init__(self, loaded: Any, rows: int) -> None:
        self.name = getattr(loaded, "name", "weight_scale")
        t = loaded.load() if hasattr(loaded, "load") else loaded
        self._t = t.float().reshape(-1)  # scales are small: read whole
        self._rows = rows
        self.shape = (self._t.numel(),) if self._t.numel() > 1 else (rows,)

    @property
    def per_tensor(self) -> bool:
        return self._t.numel() == 1

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self._t.expand(self._rows) if self.per_tensor else self._t
        if self.per_tensor:
            return self._t.expand(length)
        return self._t.narrow(0, start, length)

    def load(self) -> torch.Tensor:
        return self._t.expand(self._rows) if self.per_tensor else self._t
