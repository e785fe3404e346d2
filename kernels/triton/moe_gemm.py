"""Grouped GEMMs over experts, one tile of BLOCK_M rows of a single expert per program.

Rows come from `moe_align_block_size`: each BLOCK_M run of sorted_ids belongs to one expert, so a
program multiplies gathered activation rows by that expert's weight tile. One kernel, two uses:

- w13 GEMM (GATED): x[token] @ w13[e].T for the gate and the up half together (two accumulators
  over the same A tile), epilogue silu(gate) * up -> h: [pairs, I].
- w2 GEMM: h[pair] @ w2[e].T, epilogue times the pair's routing weight -> y: [pairs, H].
fp8 expert weights (with per-row scales) are widened to the activations' dtype as each tile is
loaded and the scales applied to the fp32 sums (weight-only: the activations stay bf16).
Programs are ordered in groups of GROUP_M row blocks so neighbouring programs reuse weight tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdmesh.kernels.triton.activation import silu_mul
from pdmesh.kernels.triton.device import dot_precision
from pdmesh.kernels.triton.moe_align import MoEAlignment


@dataclass(frozen=True)
class MoEGemmConfig:
    block_m: int
    block_n1: int  # output columns per accumulator of the w13 GEMM (gate and up each)
    block_n2: int  # output columns of the w2 GEMM
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_gemm_config(num_tokens: int, dtype: torch.dtype) -> MoEGemmConfig:
    """Tile sizes by batch size, after vLLM's tuned H100 tables for E=128 experts: decode-sized
    batches are weight-bandwidth bound (thin BLOCK_M, long BLOCK_K), large ones compute bound."""
    if num_tokens <= 64:
        cfg = MoEGemmConfig(16, 32, 64, 128, 1, 4, 4)
    elif num_tokens <= 512:
        cfg = MoEGemmConfig(32, 64, 128, 128, 8, 4, 3)
    elif num_tokens <= 2048:
        cfg = MoEGemmConfig(64, 64, 128, 64, 8, 4, 3)
    else:
        cfg = MoEGemmConfig(128, 128, 256, 64, 8, 8, 3)
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: small tiles, no spills
        cfg = MoEGemmConfig(min(cfg.block_m, 64), 32, 64, 32, cfg.group_m, 4, 2)
    return cfg


@triton.jit
def _tile_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _load_k_tile(ptrs, mask, k_mask, EVEN_K: tl.constexpr):
    # mask: the tile's rows (A) or columns (B) in range; k_mask: its K positions, needed only
    # when K is not a multiple of BLOCK_K. Both broadcast to the tile's shape.
    if not EVEN_K:
        mask = mask & k_mask
    return tl.load(ptrs, mask=mask, other=0.0)


# The pair and row-block counts change with the batch: not specialised on (no mid-run compiles).
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_m,
    N,
    K,
    stride_at,
    stride_we,
    stride_wn,
    stride_se,
    stride_ot,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    pair64 = pair.to(tl.int64)
    a_row = (pair // TOP_K).to(tl.int64)  # w13: the pair's token; w2 (TOP_K = 1): the pair
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_at + kk[None, :]  # [BLOCK_M, BLOCK_K]
    # B tiles [BLOCK_K, BLOCK_N] of w[e]: [N, K] (w2), or [2N, K] (w13): gate rows, then up rows.
    b_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + kk[:, None]
    u_ptrs = b_ptrs + N * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + kk) < K
        a = _load_k_tile(a_ptrs, row_mask[:, None], k_mask[None, :], EVEN_K)
        b = _load_k_tile(b_ptrs, col_mask[None, :], k_mask[:, None], EVEN_K)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
        if GATED:
            bu = _load_k_tile(u_ptrs, col_mask[None, :], k_mask[:, None], EVEN_K)
            acc_u = tl.dot(a, bu.to(a.dtype), acc_u, input_precision=DOT_PREC)
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:  # fp8 weights: row n of w[e] is w[e, n] * scale[e, n]
        s_ptrs = scale_ptr + expert * stride_se + cols
        acc *= tl.load(s_ptrs, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_u *= tl.load(s_ptrs + N, mask=col_mask, other=0.0)[None, :]
    if GATED:
        # The reference rounds each projection to the activation dtype before the SiLU.
        out = silu_mul(acc.to(dtype), acc_u.to(dtype), dtype)
    else:
        # As the reference: the projection in the activation dtype, times the fp32 routing weight.
        weight = tl.load(topk_weights_ptr + pair64, mask=row_mask, other=0.0).to(tl.float32)
        out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    out_ptrs = out_ptr + pair64[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, out, mask=row_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,  # [T, K] tokens (w13) or [T * k, K] pairs (w2)
    w: torch.Tensor,  # [E, 2N, K] (w13) or [E, N, K] (w2)
    out: torch.Tensor,  # [T * k, N]
    topk_weights: torch.Tensor,  # [T * k] float32, read only when not gated
    align: MoEAlignment,
    cfg: MoEGemmConfig,
    top_k: int,
    gated: bool,
    scale: torch.Tensor | None = None,  # [E, 2N] (w13) or [E, N] (w2) float32: fp8 weights
) -> torch.Tensor:
    n, k = out.shape[1], a.shape[1]
    block_n = cfg.block_n1 if gated else cfg.block_n2
    _grouped_gemm_kernel[(align.max_blocks * triton.cdiv(n, block_n),)](
        a,
        w,
        scale if scale is not None else w,
        out,
        topk_weights,
        align.sorted_ids,
        align.expert_ids,
        align.num_padded,
        out.shape[0],
        align.max_blocks,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        scale.stride(0) if scale is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        GATED=gated,
        HAS_SCALE=scale is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0,
        DOT_PREC=dot_precision(a.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def w13_silu_gemm(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    align: MoEAlignment,
    top_k: int,
    cfg: MoEGemmConfig,
    scale: torch.Tensor | None = None,  # [E, 2I] float32 for fp8 weights
) -> torch.Tensor:  # h: [T * k, I]; rows of pairs not held here are left unwritten
    h = torch.empty(x.shape[0] * top_k, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    # No routing weights here: h is passed in their place, unread.
    return _grouped_gemm(x, w13, h, h, align, cfg, top_k, gated=True, scale=scale)


def w2_gemm(
    h: torch.Tensor,  # [T * k, I]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T * k] float32
    align: MoEAlignment,
    cfg: MoEGemmConfig,
    scale: torch.Tensor | None = None,  # [E, H] float32 for fp8 weights
) -> torch.Tensor:  # y: [T * k, H], weighted; rows of pairs not held here are left unwritten
    y = torch.empty(h.shape[0], w2.shape[1], dtype=h.dtype, device=h.device)
    return _grouped_gemm(h, w2, y, topk_weights, align, cfg, top_k=1, gated=False, scale=scale)
