"""Triton RMSNorm and fused residual-add + RMSNorm against the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import fused_add_rms_norm, rms_norm
from pdmesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref

Check = Callable[[torch.Tensor, torch.Tensor], None]
EPS = 1e-6

# (leading shape, hidden): per-head norms (3D), a non-power-of-two width, a Llama-sized row.
SHAPES = [((5,), 64), ((3, 4), 128), ((9,), 1000), ((2,), 4096)]


def _inputs(
    lead: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # x is a column slice of a wider tensor: rows are not dense, as q/k taken from a fused qkv.
    wide = torch.randn(*lead, hidden + 24, generator=g) * 3
    x = wide.to(device, dtype)[..., :hidden]
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    return x, weight


@pytest.mark.parametrize(("lead", "hidden"), SHAPES)
def test_rms_norm_matches_reference(
    lead: tuple[int, ...],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    x, weight = _inputs(lead, hidden, dtype, device, seed=hidden)
    assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))


@pytest.mark.parametrize(("lead", "hidden"), SHAPES)
def test_fused_add_rms_norm_matches_reference(
    lead: tuple[int, ...],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    x, weight = _inputs(lead, hidden, dtype, device, seed=hidden)
    residual, _ = _inputs(lead, hidden, dtype, device, seed=hidden + 1)
    before = residual.clone()

    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert_close(out, ref_out)
    assert_close(new_residual, ref_residual)
    assert torch.equal(residual, before)  # out of place, as the reference


def test_rms_norm_keeps_an_fp32_weight_over_half_activations(device: torch.device) -> None:
    # torch promotes bf16 activations times an fp32 weight to fp32; so must the kernel.
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    weight = torch.rand(64, device=device) + 0.5
    out = rms_norm(x, weight, EPS)
    ref = rms_norm_ref(x, weight, EPS)
    assert out.dtype == ref.dtype == torch.float32
    # The row is rounded to bf16 before the weight: a one-ulp (2^-8) difference is allowed.
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=1e-5)
