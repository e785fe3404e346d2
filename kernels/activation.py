"""SiLU(gate) * up over a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdmesh.kernels.backend import pick


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] -> [T, I]
    return pick("silu_and_mul", x, silu_and_mul_ref)(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
