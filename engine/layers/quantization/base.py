"""The contract of a quantization method: how it replaces a layer's weights and runs the layer.

A method is applied to a built model before any weight is loaded (`apply_quantization`): it swaps
each linear layer's `weight` for its own parameters (keeping the layer's `weight_loader`, whose
rows go through `rows.store_rows`) and sets the layer's `quant_method`, which the layer's forward
calls. Callers may rely on `apply` computing y = x W^T (+ b) to the method's precision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pdmesh.kernels import linear, silu_and_mul_linear


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace `layer.weight` ([N, K]) with this method's parameters."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, K] -> [T, N]."""

    @abstractmethod
    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [T, 2K] = an MLP's [gate | up] -> the layer of silu(gate) * up: [T, N]."""


class UnquantizedLinear(LinearMethod):
    """The layer's own weight in the model's dtype."""

    def create_weights(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return silu_and_mul_linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinear()
