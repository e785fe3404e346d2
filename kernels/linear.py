"""Linear projections y = x W^T (+ b), and an MLP's down projection straight from its
[gate | up] output.

At batch 1 a projection only streams its weight matrix, and the matmul library's small-M kernels
leave a share of the memory bandwidth unused on narrow matrices (a tensor-parallel shard's most
of all). Inside CUDA graphs those go to a GEMV kernel of ours (`triton/gemv.py`, which says
which); everything else, and every eager call, goes to `torch.nn.functional.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.backend import pick


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, K], weight: [N, K], bias: [N] -> [T, N]
    return pick("linear", x, linear_ref)(x, weight, bias)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """An MLP's down projection of its [gate | up] output: linear(silu(gate) * up)."""
    # x: [T, 2K], weight: [N, K], bias: [N] -> [T, N]
    return pick("silu_and_mul_linear", x, silu_and_mul_linear_ref)(x, weight, bias)


def silu_and_mul_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(silu_and_mul_ref(x), weight, bias)
