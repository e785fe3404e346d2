"""y = x W^T (+ b) for a few rows of x: each weight element read once, at the memory's rate.
With GATED, x is an MLP's [gate | up] projection and the product is silu(gate) * up times W^T:
the activation is computed as each tile of x is loaded, so it needs no kernel of its own.

One program per BLOCK_N output features: it streams those rows of W (contiguous along K, 16-byte
loads, evicted first: nothing reads them again this step) and multiplies each tile by every row
of x. Products accumulate elementwise in a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 tile and are summed
over K once at the end, so the loop has no cross-thread reduction; or, with
`GemvConfig.reduce_each_tile`, each tile is summed at once, holding fewer registers across the
loop (faster for fp8 weights wider than deep, measured: fp8_linear.fp8_gemv_config). Rows past
N re-read row N - 1 (never stored) instead of masking, which keeps the loads along K unmasked. An
fp8 weight (with per-row scales) is widened to fp32 as it is loaded and its sums scaled once at
the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdmesh import envs
from pdmesh.kernels.backend import register_triton
from pdmesh.kernels.triton.activation import silu_and_mul, silu_mul
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous

# Output features above which the matmul library streams the weight as fast (measured).
MAX_OUTPUTS = 8192


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # Sum each K tile's products at once into a [BLOCK_M, BLOCK_N] accumulator, instead of
    # elementwise into [BLOCK_M, BLOCK_N, BLOCK_K] and over K once at the end: a reduction
    # across threads every tile, for far fewer registers held across the loop.
    reduce_each_tile: bool = False


@triton.jit
def load_x_tile(ptrs, mask, K, GATED: tl.constexpr):
    """A tile of x; GATED: silu(gate) * up, gate at `ptrs` and up K elements further."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        x = silu_mul(x, tl.load(ptrs + K, mask=mask, other=0.0), x.dtype)
    return x


@triton.jit
def load_weight_tile(w_ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of W, evicted first (nothing reads it again this step)."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def x_tile_mask(row_ok, k_ok, EVEN_K: tl.constexpr):
    """Which elements of a [BLOCK_M, BLOCK_K] tile of x exist (rows past M do not)."""
    return row_ok[:, None] if EVEN_K else row_ok[:, None] & k_ok[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    REDUCE_EACH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # The first tile of W is read before waiting for the kernel that wrote x (with programmatic
    # dependent launch, that kernel may still be running: W does not depend on it).
    k_ok = ks < K
    w = load_weight_tile(w_ptrs, k_ok, EVEN_K)
    wait_for_previous(USE_PDL)
    x = load_x_tile(x_ptrs, x_tile_mask(row_ok, k_ok, EVEN_K), K, GATED)
    acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if REDUCE_EACH:
        acc = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_ok = (k0 + ks) < K
        w = load_weight_tile(w_ptrs, k_ok, EVEN_K)
        x = load_x_tile(x_ptrs, x_tile_mask(row_ok, k_ok, EVEN_K), K, GATED)
        products = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if REDUCE_EACH:
            acc += tl.sum(products, axis=2)
        else:
            acc += products
    y = acc if REDUCE_EACH else tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_SCALE:  # an fp8 weight: row n of W is w[n] * scale[n]
        y *= tl.load(s_ptr + w_rows)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + w_rows).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def default_config(rows: int, n: int, k: int) -> GemvConfig:
    """Launch shape for `rows` rows of x against an [n, k] weight: the fastest single shape over
    Llama-3.1-8B's narrow projections, whole and as TP=2 shards, on an H200 (bench/gemv_gpu.py;
    BENCHMARKS.md). Wider outputs take shorter K tiles: more programs per row block in flight."""
    block_k = 256 if rows > 1 else 1024 if n <= 4096 else 512
    return GemvConfig(
        block_n=8, block_k=min(block_k, triton.next_power_of_2(k)), num_warps=4, num_stages=1
    )


def fits(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `x @ weight.T` is a product the GEMV kernel is for: a few rows
    (PDMESH_GEMV_MAX_ROWS) against a weight of at most MAX_OUTPUTS rows, both dense along K.
    Wider weights (an MLP's gate/up, the LM head) already stream at the memory's rate in the
    library's kernels, and more rows than one are faster there too (measured). gated: x holds
    [gate | up], twice the weight's K."""
    k = weight.shape[-1] * (2 if gated else 1)
    return (
        x.dim() == 2
        and x.shape[1] == k
        and 0 < x.shape[0] <= envs.gemv_max_rows()
        and 0 < weight.shape[0] <= MAX_OUTPUTS
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _in_graph(x: torch.Tensor) -> bool:
    """The kernel runs only inside CUDA graphs: Triton's launch from Python costs tens of
    microseconds, more than these products take on the GPU, and a graph's replay skips it."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    gated: bool = False,
    scale: torch.Tensor | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    # x: [M, K] (or [M, 2K] = [gate | up] when gated), weight: [N, K], bias: [N] -> [M, N];
    # scale: [N] float32 for an fp8 weight (row n is weight[n] * scale[n])
    n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k * (2 if gated else 1):
        raise ValueError(f"x has {x.shape[1]} features for a weight of {k}{' (gated)' * gated}")
    cfg = config or default_config(m, n, k)
    use_pdl = pdl(x.device) if use_pdl is None else use_pdl
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        GATED=gated,
        EVEN_K=k % cfg.block_k == 0,
        USE_PDL=use_pdl,
        REDUCE_EACH=cfg.reduce_each_tile,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(use_pdl),
    )
    return y


@register_triton("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, K], weight: [N, K] -> [T, N]
    if _in_graph(x) and fits(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@register_triton("silu_and_mul_linear")
def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # x: [T, 2K] = [gate | up], weight: [N, K] -> [T, N]
    if _in_graph(x) and fits(x, weight, gated=True):
        return gemv(x, weight, bias, gated=True)
    return F.linear(silu_and_mul(x), weight, bias)
