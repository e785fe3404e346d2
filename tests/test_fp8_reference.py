"""FP8 (e4m3) references: row quantization, the W8A8 product, and the options that turn it on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdmesh.engine.config import QUANTIZATIONS, EngineConfig
from pdmesh.engine.layers.quantization.registry import QUANTIZATIONS as METHODS
from pdmesh.kernels import fp8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_rows_maps_each_row_max_to_448_and_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0  # an all-zero row: scale stays positive, values stay 0 (no 0 / 0)
    q, scale = fp8.quantize_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.isfinite(q.float()).all() and (scale > 0).all()
    nonzero = [0, 1, 3, 4, 5]
    assert torch.equal(q.float()[nonzero].abs().amax(dim=1), torch.full((5,), 448.0))
    assert torch.equal(q.float()[2], torch.zeros(300))
    back = fp8.dequantize_rows(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself (normal range), the
    # row's relative error well under that.
    for r in nonzero:
        assert _rel(back[r], x[r]) < 0.04


def test_fp8_linear_is_the_exact_product_of_the_two_quantized_matrices() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48)
    qw, sw = fp8.quantize_rows_ref(w)
    y = fp8.fp8_linear_ref(x, qw, sw, b)
    # The same product in float64 from the dequantized operands.
    qx, sx = fp8.quantize_rows_ref(x)
    xd, wd = qx.double() * sx.double()[:, None], qw.double() * sw.double()[:, None]
    expected = xd @ wd.t() + b.double()
    assert _rel(y, expected) < 1e-6
    assert _rel(y, F.linear(x, w, b)) < 0.06  # and close to the unquantized product


def test_gated_fp8_linear_quantizes_silu_gate_times_up() -> None:
    g = torch.Generator().manual_seed(2)
    gate_up, w = torch.randn(3, 2 * 40, generator=g) * 3, torch.randn(16, 40, generator=g)
    qw, sw = fp8.quantize_rows_ref(w)
    act = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    got = fp8.fp8_silu_and_mul_linear_ref(gate_up, qw, sw)
    assert torch.equal(got, fp8.fp8_linear_ref(act, qw, sw))


def test_quantization_option_is_checked() -> None:
    assert set(QUANTIZATIONS) == set(METHODS)  # the config's names are the registry's
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="enable_eplb does not support quantization"):
        EngineConfig(
            quantization="fp8",
            enable_eplb=True,
            enable_expert_parallel=True,
            tensor_parallel_size=2,
        )


def test_quantization_flag() -> None:
    import argparse

    from pdmesh.flags import engine_args, engine_argv, engine_options

    parser = argparse.ArgumentParser()
    engine_args(parser)
    options = engine_options(parser.parse_args(["--quantization", "fp8"]))
    assert options["quantization"] == "fp8"
    assert "--quantization" not in engine_argv(engine_options(parser.parse_args([])))
    assert engine_argv(options)[engine_argv(options).index("--quantization") + 1] == "fp8"


def test_fp8_layers_keep_float32_scales_in_a_bf16_model() -> None:
    """A bf16 model is built with bf16 as the default dtype; the scales stay float32 (the fp8
    GEMM takes no other), and bf16 rows loaded into it are quantized with float32 scales."""
    from pdmesh.engine.layers.linear import QKVParallelLinear
    from pdmesh.engine.layers.quantization.registry import apply_quantization

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = QKVParallelLinear(64, 16, 4, 2)
        apply_quantization(layer, "fp8")
    finally:
        torch.set_default_dtype(old)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, w, "q")
    q, s = fp8.quantize_rows_ref(w)
    assert torch.equal(layer.weight_scale[:64], s)
    assert torch.equal(layer.weight[:64].view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_carry_their_rows_scales(rank: int) -> None:
    """An FP8 checkpoint (per-channel q + weight_scale [N, 1]) loaded into rank `rank` of 2:
    every layer kind's fp8 rows times their scales are what the unquantized layer of that rank
    loads from the dequantized checkpoint, bit for bit (the scales follow the rows; a
    row-parallel shard keeps every row's scale)."""
    from torch import nn

    from pdmesh.engine.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from pdmesh.engine.layers.moe import FusedMoE
    from pdmesh.engine.layers.quantization.registry import apply_quantization
    from pdmesh.engine.parallel.group import ParallelGroup

    tp = ParallelGroup(rank=rank, size=2)

    def layers() -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "qkv": QKVParallelLinear(64, 16, 4, 2, tp=tp),
                "gate_up": MergedColumnParallelLinear(64, [32, 32], tp=tp),
                "o": RowParallelLinear(64, 48, tp=tp),
                "moe": FusedMoE(4, 2, 64, 32, renormalize=True, tp=tp),
            }
        )

    fp8_layers, plain = layers(), layers()
    apply_quantization(fp8_layers, "fp8")
    g = torch.Generator().manual_seed(rank)
    # (layer, parameter, checkpoint shape, shard id)
    parts = [
        ("qkv", "weight", (64, 64), "q"),
        ("qkv", "weight", (32, 64), "k"),
        ("qkv", "weight", (32, 64), "v"),
        ("gate_up", "weight", (32, 64), 0),
        ("gate_up", "weight", (32, 64), 1),
        ("o", "weight", (48, 64), None),
        ("moe", "w13_weight", (32, 64), (1, "gate")),
        ("moe", "w13_weight", (32, 64), (1, "up")),
        ("moe", "w2_weight", (64, 32), (1, "down")),
    ]
    for layer, name, shape, shard in parts:
        q, s = fp8.quantize_rows_ref(torch.randn(*shape, generator=g))
        w, scale = getattr(fp8_layers[layer], name), getattr(fp8_layers[layer], name + "_scale")
        w.weight_loader(w, q, shard)
        scale.weight_loader(scale, s[:, None], shard)
        p = getattr(plain[layer], name)
        p.weight_loader(p, fp8.dequantize_rows(q, s, torch.float32), shard)
    for layer, name in [("qkv", "weight"), ("gate_up", "weight"), ("o", "weight")]:
        got = getattr(fp8_layers[layer], name), getattr(fp8_layers[layer], name + "_scale")
        assert torch.equal(fp8.dequantize_rows(*got, torch.float32), plain[layer].weight), layer
    for name in ("w13_weight", "w2_weight"):
        got = fp8.dequantize_rows(
            getattr(fp8_layers["moe"], name)[1],
            getattr(fp8_layers["moe"], name + "_scale")[1],
            torch.float32,
        )
        assert torch.equal(got, getattr(plain["moe"], name)[1]), name
