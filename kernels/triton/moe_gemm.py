"""Grouped GEMMs over experts, one tile of BLOCK_M rows of a single expert per program.

Rows come from `moe_align_block_size`: each BLOCK_M run of sorted_ids belongs to one expert, so a
program multiplies gathered activation rows by that expert's weight tile.

- w13 GEMM: x[token] @ w13[e].T for the gate and the up half together (two accumulators over the
  same A tile), epilogue silu(gate) * up -> h: [pairs, I].
- w2 GEMM: h[pair] @ w2[e].T, epilogue times the pair's routing weight -> y: [pairs, H].
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
def _w13_silu_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_m,
    inter,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + kk[None, :]  # [BLOCK_M, BLOCK_K]
    # w13[e]: [2I, H]; tiles [BLOCK_K, BLOCK_N] of its gate rows and the matching up rows.
    g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + kk[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=col_mask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + kk) < hidden
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc_g = tl.dot(a, bg.to(a.dtype), acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, bu.to(a.dtype), acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # The reference rounds each projection to the activation dtype before the SiLU.
    dtype = h_ptr.dtype.element_ty
    h = silu_mul(acc_g.to(dtype), acc_u.to(dtype), dtype)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + cols[None, :]
    tl.store(h_ptrs, h, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _w2_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_m,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    pair64 = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pair64[:, None] * stride_ht + kk[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + kk[:, None]  # w2[e]: [H, I]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + kk) < inter
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # As the reference: the projection in the activation dtype, times the fp32 routing weight.
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + pair64, mask=row_mask, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    y_ptrs = y_ptr + pair64[:, None] * stride_yt + cols[None, :]
    tl.store(y_ptrs, y.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def w13_silu_gemm(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    align: MoEAlignment,
    top_k: int,
    cfg: MoEGemmConfig,
) -> torch.Tensor:  # h: [T * k, I]; rows of pairs not held here are left unwritten
    hidden = x.shape[1]
    inter = w13.shape[1] // 2
    num_pairs = x.shape[0] * top_k
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (align.max_blocks * triton.cdiv(inter, cfg.block_n1),)
    _w13_silu_kernel[grid](
        x,
        w13,
        h,
        align.sorted_ids,
        align.expert_ids,
        align.num_padded,
        num_pairs,
        align.max_blocks,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n1,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=hidden % cfg.block_k == 0,
        DOT_PREC=dot_precision(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return h


def w2_gemm(
    h: torch.Tensor,  # [T * k, I]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T * k] float32
    align: MoEAlignment,
    cfg: MoEGemmConfig,
) -> torch.Tensor:  # y: [T * k, H], weighted; rows of pairs not held here are left unwritten
    num_pairs, inter = h.shape
    hidden = w2.shape[1]
    y = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    grid = (align.max_blocks * triton.cdiv(hidden, cfg.block_n2),)
    _w2_kernel[grid](
        h,
        w2,
        y,
        topk_weights,
        align.sorted_ids,
        align.expert_ids,
        align.num_padded,
        num_pairs,
        align.max_blocks,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n2,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0,
        DOT_PREC=dot_precision(h.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
