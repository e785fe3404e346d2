"""MoE experts for a few tokens: two GEMV kernels, no alignment, no separate combine.

    up     x [T, H], w13 [E, 2I, H]  -> h = silu(x @ gate.T) * (x @ up.T): [T*k, I]
           grid (pairs, I / BLOCK_N): each program streams BLOCK_N gate rows and the matching up
           rows of its pair's expert
    down   h, w2 [E, H, I]           -> out[t] = sum_j weight_j * (h[t, j] @ w2[e_j].T): [T, H]
           grid (tokens, H / BLOCK_N): each program reads its token's k experts' rows together

At decode batch sizes (a token's k pairs almost never share an expert) the grouped GEMMs' row
alignment (three kernels, plus the buffers it zeroes) and the combine cost more launches than the
expert weights take to stream; these two kernels read each held expert's weights once per pair.
The products are rounded as the grouped path rounds them (each projection to the activations'
dtype, the weighted down projection again before the sum), and pairs of experts held on other
ranks (or slot -1) are skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdmesh.kernels.triton.activation import silu_mul
from pdmesh.kernels.triton.device import last_dim_contiguous
from pdmesh.kernels.triton.gemv import load_weight_tile
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous

# Batches of at most this many tokens take these kernels; larger ones the grouped GEMMs, which
# read an expert's weights once for all of its rows. Qwen3-30B-A3B's layer on an H200 (µs, GEMV
# kernels against grouped GEMMs, all 128 experts / 64 of them): 1 token 29 / 37, 19 / 29;
# 4 tokens 80 / 87, 54 / 60; 8 tokens 140 / 133, 87 / 80 (bench/moe_layer_gpu.py, BENCHMARKS.md).
MAX_TOKENS = 4


class ExpertGemvConfig(NamedTuple):
    up_block_n: int  # intermediate features an up program computes (gate and up rows each)
    up_block_k: int  # hidden features a step of its loop reads
    up_warps: int
    down_block_n: int  # hidden features a down program computes
    down_block_k: int  # intermediate features a step of its loop reads (of all k experts)
    down_warps: int


def default_config(hidden: int, inter: int) -> ExpertGemvConfig:
    """The launch shapes with the least time summed over 1, 2 and 4 tokens, all 128 experts and
    64 of them, of Qwen3-30B-A3B's layer on an H200 (`bench/moe_layer_gpu.py --sweep`)."""
    return ExpertGemvConfig(
        up_block_n=8,
        up_block_k=min(256, triton.next_power_of_2(hidden)),
        up_warps=4,
        down_block_n=16,
        down_block_k=min(128, triton.next_power_of_2(inter)),
        down_warps=8,
    )


@triton.jit
def _load_w_tile(w_ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of weight rows in fp32 (read once a step: evicted first)."""
    return load_weight_tile(w_ptrs, k_ok, EVEN_K).to(tl.float32)


@triton.jit
def _load_row_tiles(x_ptrs, w_ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BLOCK_K] tile of an activation row and a [BLOCK_N, BLOCK_K] tile of weight rows."""
    x = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=k_ok, other=0.0)
    return x.to(tl.float32), _load_w_tile(w_ptrs, k_ok, EVEN_K)


@triton.jit
def _up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    h_ptr,
    first_expert,
    num_local,
    I,  # noqa: E741 (the intermediate size, as in the shapes above)
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_ht,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)  # the expert ids: the routing kernel's
    e = tl.load(ids_ptr + pair) - first_expert
    if (e < 0) | (e >= num_local):  # held on another rank: h's row stays unwritten, unread
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, I - 1).to(tl.int64)  # rows past I re-read row I - 1, never stored
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + I * stride_wn
    x_ptrs = x_ptr + (pair // TOP_K) * stride_xt + ks
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x, g = _load_row_tiles(x_ptrs, g_ptrs, k_ok, EVEN_K)
        u = _load_w_tile(u_ptrs, k_ok, EVEN_K)
        acc_g += x[None, :] * g
        acc_u += x[None, :] * u
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, 1)  # [BLOCK_N]
    up = tl.sum(acc_u, 1)
    if HAS_SCALE:  # fp8 weights: row n of w13[e] is w13[e, n] * scale[e, n]
        gate *= tl.load(s_ptr + e * stride_se + rows)
        up *= tl.load(s_ptr + e * stride_se + I + rows)
    dtype = h_ptr.dtype.element_ty
    h = silu_mul(gate.to(dtype), up.to(dtype), dtype)
    tl.store(h_ptr + pair * stride_ht + cols, h, mask=cols < I)


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    first_expert,
    num_local,
    N,
    K,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_ot,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # All k experts of the token at once: a [BLOCK_J, BLOCK_N, BLOCK_K] tile of their rows per
    # step (one program would otherwise wait on k small loads in turn). Experts held elsewhere
    # are masked off, so their rows are never read.
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(USE_PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_J)
    pairs = t * TOP_K + j
    e = tl.load(ids_ptr + pairs, mask=j < TOP_K, other=-1) - first_expert  # [BLOCK_J]
    held = (j < TOP_K) & (e >= 0) & (e < num_local)
    e = tl.where(held, e, 0)
    w_ptrs = (
        w_ptr + e[:, None, None] * stride_we + rows[None, :, None] * stride_wn + ks[None, None, :]
    )  # [BLOCK_J, BLOCK_N, BLOCK_K]
    h_ptrs = h_ptr + pairs[:, None] * stride_ht + ks[None, :]  # [BLOCK_J, BLOCK_K]
    acc = tl.zeros([BLOCK_J, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h_mask = held[:, None] if EVEN_K else held[:, None] & ((k0 + ks) < K)[None, :]
        h = tl.load(h_ptrs, mask=h_mask, other=0.0)
        w = tl.load(w_ptrs, mask=h_mask[:, None, :], other=0.0, eviction_policy="evict_first")
        acc += h.to(tl.float32)[:, None, :] * w.to(tl.float32)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 2)  # [BLOCK_J, BLOCK_N]
    if HAS_SCALE:
        y *= tl.load(s_ptr + e[:, None] * stride_se + rows[None, :], mask=held[:, None], other=0.0)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=held, other=0.0)
    # As the grouped path: the projection in the activations' dtype, times the fp32 routing
    # weight, rounded again; then the pairs summed in fp32.
    y = (y.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)
    total = tl.sum(tl.where(held[:, None], y, 0.0), 0)  # [BLOCK_N]
    tl.store(out_ptr + t * stride_ot + cols, total.to(dtype), mask=cols < N)


def up_projection(
    x: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H]
    topk_ids: Tensor,  # [T, k] contiguous
    first_expert: int,
    w13_scale: Tensor | None,
    cfg: ExpertGemvConfig,
) -> Tensor:  # h: [T * k, I]; rows of pairs not held here are left unwritten
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x.device)
    _up_kernel[(num_tokens * top_k, triton.cdiv(inter, cfg.up_block_n))](
        x,
        w13,
        w13_scale if w13_scale is not None else w13,
        topk_ids,
        h,
        first_expert,
        num_local,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0) if w13_scale is not None else 0,
        h.stride(0),
        TOP_K=top_k,
        HAS_SCALE=w13_scale is not None,
        EVEN_K=hidden % cfg.up_block_k == 0,
        BLOCK_N=cfg.up_block_n,
        BLOCK_K=cfg.up_block_k,
        USE_PDL=use_pdl,
        num_warps=cfg.up_warps,
        **pdl_launch(use_pdl),
    )
    return h


def down_projection(
    h: Tensor,  # [T * k, I]
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, k] float32, contiguous
    topk_ids: Tensor,  # [T, k] contiguous
    first_expert: int,
    w2_scale: Tensor | None,
    cfg: ExpertGemvConfig,
    dtype: torch.dtype,
) -> Tensor:  # [T, H]: each token's weighted sum over its experts held here
    num_local, hidden, inter = w2.shape
    num_tokens, top_k = topk_ids.shape
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=h.device)
    use_pdl = pdl(h.device)
    _down_kernel[(num_tokens, triton.cdiv(hidden, cfg.down_block_n))](
        h,
        w2,
        w2_scale if w2_scale is not None else w2,
        topk_ids,
        topk_weights,
        out,
        first_expert,
        num_local,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0) if w2_scale is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        HAS_SCALE=w2_scale is not None,
        EVEN_K=inter % cfg.down_block_k == 0,
        BLOCK_J=triton.next_power_of_2(top_k),
        BLOCK_N=cfg.down_block_n,
        BLOCK_K=cfg.down_block_k,
        USE_PDL=use_pdl,
        num_warps=cfg.down_warps,
        **pdl_launch(use_pdl),
    )
    return out


def moe_experts_gemv(
    x: Tensor,  # [T, H]
    w13: Tensor,  # [E_local, 2I, H]
    w2: Tensor,  # [E_local, H, I]
    topk_weights: Tensor,  # [T, k] float32
    topk_ids: Tensor,  # [T, k] global expert ids (or physical slots)
    first_expert: int,
    w13_scale: Tensor | None = None,  # [E_local, 2I] float32: w13 is fp8
    w2_scale: Tensor | None = None,  # [E_local, H] float32: w2 is fp8
    config: ExpertGemvConfig | None = None,
) -> Tensor:  # [T, H]
    if x.shape[0] == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = config or default_config(x.shape[1], w2.shape[2])
    x = last_dim_contiguous(x)
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    h = up_projection(x, w13, ids, first_expert, w13_scale, cfg)
    return down_projection(h, w2, weights, ids, first_expert, w2_scale, cfg, x.dtype)
