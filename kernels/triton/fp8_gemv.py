"""The fp8 GEMV with its weight widened by integer operations instead of conversion instructions.

gemv.py widens each e4m3 weight to fp32 with two conversions (e4m3 pairs to fp16 pairs, then fp16
to fp32), and at one byte per weight the kernel issues those as fast as the memory delivers them.
Here four weights are read as one int32 word and each becomes an fp32 by a shift and a masked
merge (integer units): its sign to bit 31, its 7 exponent and mantissa bits to bits 20-26. The
fp32 read back is the weight times 2^-120 (e4m3's exponent bias is 7, fp32's 127; e4m3's
subnormals land on fp32's, scaled alike), and 2^120 goes into the row's scale at the end. Each
word meets the four elements of x it pairs with (x read at a stride of 4), and the four products
go into one accumulator, a quarter of gemv.py's registers for the same tile.

Same launch grid and epilogue as gemv.py's kernel: one program per BLOCK_N output rows; with
programmatic dependent launch (pdl.py) the first tile of W is read before waiting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdmesh.kernels.triton.gemv import GemvConfig, load_weight_tile, load_x_tile, x_tile_mask
from pdmesh.kernels.triton.pdl import pdl, pdl_launch, wait_for_previous


@triton.jit
def _widen(w, J: tl.constexpr):
    """Byte J of each int32 word of `w` (an e4m3 value) as an fp32 equal to it times 2^-120."""
    if J == 0:
        sign = w << 24
        mag = w << 20
    elif J == 1:
        sign = w << 16
        mag = w << 12
    elif J == 2:
        sign = w << 8
        mag = w << 4
    else:
        sign = w
        mag = w >> 4
    return ((sign & -2147483648) | (mag & 0x07F00000)).to(tl.float32, bitcast=True)


@triton.jit
def _words_times_x(acc, w, x_ptrs, x_mask, K, GATED: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N, BLOCK_C] plus the products of the words' four weights with the
    four elements of x each pairs with."""
    for j in tl.static_range(4):
        x = load_x_tile(x_ptrs + j, x_mask, K, GATED).to(tl.float32)
        acc += x[:, None, :] * _widen(w, j)[None, :, :]
    return acc


@triton.jit
def _fp8_gemv_words_kernel(
    x_ptr,
    w_ptr,  # the fp8 weight [N, K] seen as int32 words [N, K / 4]
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,  # in words
    stride_ym,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,  # words of a tile along K (4 weights each)
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cs = tl.arange(0, BLOCK_C)
    row_ok = rows < M
    words = K // 4
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + cs[None, :]  # [BLOCK_N, BLOCK_C]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + 4 * cs[None, :]  # [BLOCK_M, BLOCK_C]
    c_ok = cs < words
    w = load_weight_tile(w_ptrs, c_ok, EVEN)  # before the wait: no earlier kernel writes W
    wait_for_previous(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], dtype=tl.float32)
    acc = _words_times_x(acc, w, x_ptrs, x_tile_mask(row_ok, c_ok, EVEN), K, GATED)
    for c0 in range(BLOCK_C, words, BLOCK_C):
        w_ptrs += BLOCK_C
        x_ptrs += 4 * BLOCK_C
        c_ok = (c0 + cs) < words
        w = load_weight_tile(w_ptrs, c_ok, EVEN)
        acc = _words_times_x(acc, w, x_ptrs, x_tile_mask(row_ok, c_ok, EVEN), K, GATED)
    y = tl.sum(acc, axis=2) * 1.152921504606846976e18  # [BLOCK_M, BLOCK_N], times 2^60
    y *= (tl.load(s_ptr + w_rows) * 1.152921504606846976e18)[None, :]  # the scale times 2^60
    if HAS_BIAS:
        y += tl.load(b_ptr + w_rows).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def fits(qweight: torch.Tensor) -> bool:
    """Whether the weight can be read as int32 words: dense rows of a multiple of 4 bytes."""
    k = qweight.shape[-1]
    return k % 4 == 0 and qweight.stride(-1) == 1 and qweight.stride(0) % 4 == 0


def fp8_gemv_words(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    gated: bool = False,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    # x: [M, K] (or [M, 2K] = [gate | up] when gated), qweight: [N, K] fp8, scale: [N] float32,
    # bias: [N] -> [M, N] in x's dtype
    n, k = qweight.shape
    m = x.shape[0]
    if x.shape[1] != k * (2 if gated else 1):
        raise ValueError(f"x has {x.shape[1]} features for a weight of {k}{' (gated)' * gated}")
    if not fits(qweight):
        raise ValueError(f"an fp8 weight of {k} columns cannot be read as int32 words")
    words = qweight.view(torch.int32)  # [N, K / 4]
    block_c = max(1, min(config.block_k, triton.next_power_of_2(k)) // 4)
    use_pdl = pdl(x.device) if use_pdl is None else use_pdl
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_words_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        words,
        scale,
        bias if bias is not None else scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        words.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        EVEN=(k // 4) % block_c == 0,
        USE_PDL=use_pdl,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_C=block_c,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(use_pdl),
    )
    return y
