"""Triton FP8 kernels against their torch references: per-token quantization (plain and fused
with SiLU-and-mul), the fp8 GEMV (weight-only), the W8A8 wrappers and the fp8 MoE experts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import fp8
from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.moe import moe_experts, moe_experts_ref, moe_route_ref
from pdmesh.kernels.triton import fp8_linear

Check = Callable[[torch.Tensor, torch.Tensor], None]


def _randn(*shape: int, seed: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


@pytest.mark.parametrize(("rows", "k"), [(1, 64), (5, 300), (3, 2500)])  # 2500: two K tiles
def test_quantize_rows_matches_reference(rows: int, k: int, dtype, device) -> None:
    x = _randn(rows, k, seed=k, device=device, dtype=dtype) * 5
    x[0, :7] = 0.0
    q, s = fp8_linear.quantize_rows(x)
    q_ref, s_ref = fp8.quantize_rows_ref(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit for bit


def test_quantize_rows_gated_fuses_silu_and_mul(dtype, device) -> None:
    """Bit for bit the quantization of the SiLU kernel's output (on a GPU Triton's exp is not
    torch's to the last bit, so the comparison is with the unfused Triton SiLU)."""
    from pdmesh.kernels.triton.activation import silu_and_mul

    gate_up = _randn(4, 2 * 96, seed=3, device=device, dtype=dtype) * 3
    q, s = fp8_linear.quantize_rows(gate_up, gated=True)
    act = silu_and_mul(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((act - silu_and_mul_ref(gate_up)).float().norm() / act.float().norm()) < tol
    q_ref, s_ref = fp8.quantize_rows_ref(act)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("gated", [False, True])
# Wider than deep (300 x 96, 520 x 256): one row sums each K tile at once (fp8_gemv_config).
@pytest.mark.parametrize(("n", "k"), [(64, 512), (45, 200), (13, 1100), (300, 96), (520, 256)])
def test_fp8_gemv_is_the_dequantized_weights_product(
    n: int, k: int, gated: bool, dtype, device, assert_close: Check
) -> None:
    """Weight-only: the activations stay as they are, the fp8 weight times its row scales."""
    x = _randn(1, k * (2 if gated else 1), seed=n, device=device, dtype=dtype)
    qw, sw = fp8.quantize_rows_ref(_randn(n, k, seed=n + 1, device=device))
    bias = _randn(n, seed=n + 2, device=device, dtype=dtype)
    y = fp8_linear._fp8_gemv(x, qw, sw, bias, gated=gated)
    act = silu_and_mul_ref(x) if gated else x
    ref = torch.nn.functional.linear(act, fp8.dequantize_rows(qw, sw, dtype), bias)
    assert_close(y, ref)


@pytest.mark.parametrize("rows", [1, 7])
def test_fp8_linear_wrappers_match_references(rows: int, dtype, device, assert_close) -> None:
    """Outside CUDA graphs the wrappers quantize the activations and run the scaled GEMM."""
    x = _randn(rows, 2 * 64, seed=rows, device=device, dtype=dtype)
    qw, sw = fp8.quantize_rows_ref(_randn(32, 64, seed=9, device=device))
    assert_close(fp8.fp8_linear(x[:, :64], qw, sw), fp8.fp8_linear_ref(x[:, :64], qw, sw))
    assert_close(fp8.fp8_silu_and_mul_linear(x, qw, sw), fp8.fp8_silu_and_mul_linear_ref(x, qw, sw))


def test_scaled_mm_bf16_matches_the_fp32_emulation(device) -> None:
    """The bf16 path: torch._scaled_mm with rowwise scales (CPU has an implementation too)."""
    x = _randn(6, 64, seed=4, device=device)
    xq, xs = fp8.quantize_rows_ref(x)
    qw, sw = fp8.quantize_rows_ref(_randn(48, 64, seed=5, device=device))
    bias = _randn(48, seed=6, device=device, dtype=torch.bfloat16)
    got = fp8_linear.scaled_mm(xq, xs, qw, sw, bias, torch.bfloat16)
    ref = fp8.scaled_mm_ref(xq, xs, qw, sw, bias, torch.float32)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (9, 2), (70, 1)])
def test_fp8_moe_experts_match_reference(num_tokens, top_k, dtype, device, assert_close) -> None:
    num_local, hidden, inter = 4, 64, 32
    x = _randn(num_tokens, hidden, seed=num_tokens, device=device, dtype=dtype)
    q13, s13 = fp8.quantize_rows_ref(_randn(num_local * 2 * inter, hidden, seed=1, device=device))
    q2, s2 = fp8.quantize_rows_ref(_randn(num_local * hidden, inter, seed=2, device=device))
    w13, w13_scale = q13.view(num_local, 2 * inter, hidden), s13.view(num_local, 2 * inter)
    w2, w2_scale = q2.view(num_local, hidden, inter), s2.view(num_local, hidden)
    logits = _randn(num_tokens, 8, seed=3, device=device)
    weights, ids, _ = moe_route_ref(logits, top_k, renormalize=True)
    out = moe_experts(x, w13, w2, weights, ids, 2, w13_scale, w2_scale)
    ref = moe_experts_ref(x, w13, w2, weights, ids, 2, w13_scale, w2_scale)
    assert_close(out, ref)
