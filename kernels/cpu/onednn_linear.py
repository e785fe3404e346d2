"""Linear projections on x86 CPUs through oneDNN (`torch.ops.mkldnn._linear_pointwise`).

`torch.nn.functional.linear` goes to MKL's sgemm, whose kernels for a few rows (a decode batch)
leave much of the memory bandwidth unused on some x86 CPUs: on this project's 2-core AMD EPYC
build machine, 30 layers of the default model's projections ran 1.15-1.7x faster through oneDNN
at 1-24 rows and no slower at 64-256, and its 49,152-row LM head 1.5-2.3x faster at 2-64 rows
(BENCHMARKS.md, the CPU section). vLLM's CPU build takes the same library for the same reason.
On Intel CPUs MKL keeps inputs of one or two rows (`MKL_MAX_ROWS`, below).
fp32 only: oneDNN's bf16 without AVX512-BF16 is emulated. The sums are ordered differently from
MKL's, so results differ in the last bits.

Each weight is reordered once into oneDNN's blocked layout (`_reorder_linear_weight`) and kept
beside it: a plain weight makes oneDNN reorder it on every call. On the 2-core Xeon (AVX-512)
build machine the packed weights ran the 30 layers' projections in 19-28 ms at 1-16 rows against
23-35 ms unpacked. The copy costs the weights' size again in memory. A packed copy is made again
when its weight was written since (its version counter moved) and dropped with its weight.
"""

from __future__ import annotations

import weakref

import torch

from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.backend import register_cpu
from pdmesh.kernels.linear import linear_ref

AVAILABLE = torch.backends.mkldnn.is_available() and "AVX" in (
    torch.backends.cpu.get_cpu_capability() or ""
)


def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


# Inputs of at most this many rows go to MKL (`F.linear`) instead: on Intel CPUs its
# matrix-vector kernels beat oneDNN's at one or two rows (the 2-core Xeon build machine: the
# default model's 30 layers' projections in 28 ms against 36 ms at 1-2 rows, 52 against 41 at 4),
# where on AMD's they do not (the EPYC build machine: oneDNN 1.15-1.7x faster from 1 row).
MKL_MAX_ROWS = 2 if _intel() else 0


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return AVAILABLE and x.dtype is torch.float32 and weight.dtype is torch.float32


# The rows oneDNN's blocked layout is chosen for: a decode batch (the layout serves any rows).
PACK_ROWS = 16
# id(weight) -> (a weak reference to it, its version when packed, the packed copy)
_packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's blocked layout, reordered the first time and after each write."""
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        return entry[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)
    ref = weakref.ref(weight, lambda _: _packed.pop(key, None))
    _packed[key] = (ref, weight._version, packed)
    return packed


@register_cpu("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, K], weight: [N, K], bias: [N] -> [T, N]
    if not _fits(x, weight) or x.dim() != 2 or x.shape[0] <= MKL_MAX_ROWS:
        return linear_ref(x, weight, bias)
    w = packed_weight(weight)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


@register_cpu("silu_and_mul_linear")
def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, 2K] = [gate | up], weight: [N, K] -> [T, N]
    return linear(silu_and_mul_ref(x), weight, bias)
