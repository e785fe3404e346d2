"""Triton SiLU-and-multiply against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import silu_and_mul
from pdmesh.kernels.activation import silu_and_mul_ref

Check = Callable[[torch.Tensor, torch.Tensor], None]


@pytest.mark.parametrize("shape", [(7, 600), (3, 2 * 1300), (2, 3, 64)])
def test_silu_and_mul_matches_reference(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, assert_close: Check
) -> None:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4).to(device, dtype)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x))
