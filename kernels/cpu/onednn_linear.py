"""Linear projections on x86 CPUs through oneDNN (`torch.ops.mkldnn._linear_pointwise`).

`torch.nn.functional.linear` goes to MKL's sgemm, whose kernels for a few rows (a decode batch)
leave much of the memory bandwidth unused on some x86 CPUs: on this project's 2-core AMD EPYC
build machine, 30 layers of the default model's projections ran 1.15-1.7x faster through oneDNN
at 1-24 rows and no slower at 64-256, and its 49,152-row LM head 1.5-2.3x faster at 2-64 rows
(BENCHMARKS.md, the CPU section). vLLM's CPU build takes the same library for the same reason.
fp32 only: oneDNN's bf16 without AVX512-BF16 is emulated. The sums are ordered differently from
MKL's, so results differ in the last bits.
"""

from __future__ import annotations

import torch

from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.linear import linear_ref

AVAILABLE = torch.backends.mkldnn.is_available() and "AVX" in (
    torch.backends.cpu.get_cpu_capability() or ""
)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return AVAILABLE and x.dtype is torch.float32 and weight.dtype is torch.float32


@register_cpu("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, K], weight: [N, K], bias: [N] -> [T, N]
    if not _fits(x, weight) or x.dim() != 2:
        return linear_ref(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@register_cpu("silu_and_mul_linear")
def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, 2K] = [gate | up], weight: [N, K] -> [T, N]
    return linear(silu_and_mul_ref(x), weight, bias)
