"""Triton GEMV (the projections of a batch-1 decode step) against F.linear.

The engine reaches the kernel only while capturing a CUDA graph (tests/gpu checks that path);
here the kernel is called directly, and the wrappers' choice of it is checked by `fits`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import linear, silu_and_mul_linear
from pdmesh.kernels.linear import linear_ref, silu_and_mul_linear_ref
from pdmesh.kernels.triton import gemv

Check = Callable[[torch.Tensor, torch.Tensor], None]

# (N, K): K a multiple of the tile, K ragged (masked tail), N not a multiple of BLOCK_N.
SHAPES = [(64, 512), (45, 200), (13, 1100)]


def _inputs(
    rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # x is a column slice of a wider tensor (rows not dense), as activations often are.
    x = (torch.randn(rows, k + 8, generator=g)).to(device, dtype)[:, :k]
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return x, weight, bias


@pytest.fixture(autouse=True)
def _every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes up to 4 rows; the engine gives it 1 by default (PDMESH_GEMV_MAX_ROWS)."""
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "4")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_matches_linear(
    rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, assert_close: Check
) -> None:
    x, weight, bias = _inputs(rows, n, k, dtype, device, seed=rows * 1000 + n)
    assert gemv.fits(x, weight)
    assert_close(gemv.gemv(x, weight), linear_ref(x, weight))
    assert_close(gemv.gemv(x, weight, bias), linear_ref(x, weight, bias))
    assert_close(linear(x, weight, bias), linear_ref(x, weight, bias))  # the wrapper's choice


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gated_gemv_matches_silu_and_mul_then_linear(
    rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, assert_close: Check
) -> None:
    """An MLP's down projection straight from its [gate | up] output."""
    gate_up, _, bias = _inputs(rows, n, 2 * k, dtype, device, seed=rows + n)
    gate_up = gate_up * 3  # SiLU's curved part, not just its linear tail
    _, weight, _ = _inputs(rows, n, k, dtype, device, seed=rows + k)
    assert gemv.fits(gate_up, weight, gated=True)
    assert not gemv.fits(gate_up[:, :k], weight, gated=True)  # half of [gate | up]
    want = silu_and_mul_linear_ref(gate_up, weight, bias)
    assert_close(gemv.gemv(gate_up, weight, gated=True), silu_and_mul_linear_ref(gate_up, weight))
    assert_close(gemv.gemv(gate_up, weight, bias, gated=True), want)
    assert_close(silu_and_mul_linear(gate_up, weight, bias), want)
    with pytest.raises(ValueError, match="gated"):
        gemv.gemv(gate_up[:, :k], weight, gated=True)


@pytest.mark.parametrize("reduce_each_tile", [False, True])
@pytest.mark.parametrize(("block_n", "block_k"), [(4, 64), (16, 128), (8, 1024)])
def test_gemv_launch_shapes_agree(
    block_n: int,
    block_k: int,
    reduce_each_tile: bool,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    """Every launch shape the benchmark tries computes the same product."""
    x, weight, _ = _inputs(2, 45, 300, dtype, device, seed=block_n + block_k)
    cfg = gemv.GemvConfig(block_n, block_k, 4, 1, reduce_each_tile)
    assert_close(gemv.gemv(x, weight, config=cfg), linear_ref(x, weight))
    gate_up = torch.cat([x, x.flip(0)], dim=1) * 3
    want = silu_and_mul_linear_ref(gate_up, weight)
    assert_close(gemv.gemv(gate_up, weight, config=cfg, gated=True), want)


def test_what_the_gemv_is_for(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, _ = _inputs(5, 24, 64, torch.float32, device, seed=7)
    assert gemv.fits(x[:4], weight) and not gemv.fits(x, weight)  # at most 4 rows
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "1")  # the default
    assert gemv.fits(x[:1], weight) and not gemv.fits(x[:2], weight)
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "0")
    assert not gemv.fits(x[:1], weight)
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "5")
    with pytest.raises(ValueError, match="PDMESH_GEMV_MAX_ROWS"):
        gemv.fits(x[:1], weight)
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "1")
    wide = torch.zeros(gemv.MAX_OUTPUTS + 1, 64, device=device)  # only its shape is looked at
    assert gemv.fits(x[:1], wide[: gemv.MAX_OUTPUTS]) and not gemv.fits(x[:1], wide)
    transposed = weight.t().contiguous().t()  # same values, columns dense instead of rows
    assert not gemv.fits(x[:1], transposed)
    assert not gemv.fits(x[:1].double(), weight)
