"""The kernel benchmark's cases: inputs at real model shapes, the two implementations, and the
bytes and FLOPs each call must at least move and compute."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shapes:
    """Llama-3.1-8B's dimensions for attention, norms, rotary and the MLP; Qwen3-30B-A3B's for MoE.
    SMOKE shrinks everything so that the script can be checked under the Triton interpreter."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    inter: int = 14336
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_contexts: tuple[int, ...] = (1024, 4096)
    # (new tokens, context) per sequence of each prefill batch
    prefills: tuple[tuple[tuple[int, int], ...], ...] = (
        ((4096, 4096),),
        ((1024, 1024),) * 4,
        ((2048, 4096),),  # half of the prompt already in the prefix cache
    )
    token_counts: tuple[int, ...] = (64, 4096)
    experts: int = 128
    top_k: int = 8
    moe_hidden: int = 2048
    moe_inter: int = 768
    moe_tokens: tuple[int, ...] = (1, 64, 4096)
    # (outputs, inputs) of the batch-1 decode projections the GEMV takes: qkv, o, and the
    # TP=2 shards of qkv and o; the down projection is the gated case (from [gate | up]).
    projections: tuple[tuple[int, int], ...] = (
        (6144, 4096),
        (4096, 4096),
        (3072, 4096),
        (4096, 2048),
    )


SMOKE = Shapes(
    heads=4, kv_heads=2, head_dim=64, hidden=128, inter=96,
    decode_batches=(2,), decode_contexts=(40,), prefills=(((33, 33),), ((20, 50), (7, 7))),
    token_counts=(5,), experts=8, top_k=2, moe_hidden=64, moe_inter=32, moe_tokens=(3,),
    projections=((40, 96),),
)  # fmt: skip


@dataclass
class Case:
    kernel: str
    shape: str
    triton_fn: Callable[[], object]
    torch_fn: Callable[[], object]
    bytes_moved: float  # the least a call must read + write
    flops: float
    # Relative error of the Triton result; default: compare the two functions' outputs.
    check: Callable[[], float] | None = None


def rel_err(out: object, ref: object) -> float:
    """max over outputs of ‖out - ref‖ / ‖ref‖ (NaN propagates)."""
    if isinstance(out, tuple | list):
        return max(rel_err(o, r) for o, r in zip(out, ref, strict=True))  # type: ignore[arg-type]
    assert isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)
    a, b = out.double(), ref.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _paged_cache(
    contexts: list[int], s: Shapes, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding every context in shuffled pages (block 0 unused) and the tables."""
    pages = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(pages) + 1
    shape = (num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    for i, n in enumerate(pages):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return k_cache, v_cache, tables.to(device)


def attention_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    from pdmesh.kernels.attention import (
        paged_decode_attention_ref,
        paged_prefill_attention_ref,
        store_kv_cache_ref,
    )
    from pdmesh.kernels.triton import decode_attention, kv_store, prefill_attention

    kv_token_bytes = 2 * s.kv_heads * s.head_dim * torch.tensor([], dtype=dtype).element_size()
    for tokens in s.token_counts:
        key = torch.randn(tokens, s.kv_heads, s.head_dim, dtype=dtype, device=device)
        value = torch.randn_like(key)
        k_cache, v_cache, _ = _paged_cache([tokens], s, dtype, device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=device)[:tokens]

        def store_check(key=key, value=value, kc=k_cache, vc=v_cache, kr=k_ref, vr=v_ref, sl=slots):
            kv_store.store_kv_cache(key, value, kc, vc, sl)
            store_kv_cache_ref(key, value, kr, vr, sl)
            return max(rel_err(kc, kr), rel_err(vc, vr))

        yield Case(
            "store_kv_cache",
            f"T={tokens}",
            lambda a=(key, value, k_cache, v_cache, slots): kv_store.store_kv_cache(*a),
            lambda a=(key, value, k_ref, v_ref, slots): store_kv_cache_ref(*a),
            2 * tokens * kv_token_bytes,
            0.0,
            store_check,
        )

    for batch in s.decode_batches:
        for ctx in s.decode_contexts:
            k_cache, v_cache, tables = _paged_cache([ctx] * batch, s, dtype, device)
            q = torch.randn(batch, s.heads, s.head_dim, dtype=dtype, device=device)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            args = (q, k_cache, v_cache, tables, lens, s.head_dim**-0.5, ctx)
            yield Case(
                "paged_decode_attention",
                f"B={batch} ctx={ctx}",
                lambda a=args: decode_attention.paged_decode_attention(*a),
                lambda a=args: paged_decode_attention_ref(*a),
                batch * ctx * kv_token_bytes + 2 * _nbytes(q),
                4.0 * batch * s.heads * ctx * s.head_dim,
            )

    for seqs in s.prefills:
        q_lens = [q for q, _ in seqs]
        contexts = [c for _, c in seqs]
        k_cache, v_cache, tables = _paged_cache(contexts, s, dtype, device)
        q = torch.randn(sum(q_lens), s.heads, s.head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(contexts, dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, cu.to(device), lens, tables, s.head_dim**-0.5)
        args += (max(q_lens), max(contexts))
        # Query j of a sequence sees (context - q_len + j + 1) keys.
        visible = sum(ql * (c - ql) + ql * (ql + 1) // 2 for ql, c in seqs)
        yield Case(
            "paged_prefill_attention",
            "+".join(f"{ql}/{c}" for ql, c in seqs) + " (new/ctx)",
            lambda a=args: prefill_attention.paged_prefill_attention(*a),
            lambda a=args: paged_prefill_attention_ref(*a),
            2 * _nbytes(q) + sum(contexts) * kv_token_bytes,
            4.0 * s.heads * s.head_dim * visible,
        )


def pointwise_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    from pdmesh.kernels.activation import silu_and_mul_ref
    from pdmesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
    from pdmesh.kernels.rotary import apply_rotary_ref
    from pdmesh.kernels.triton import activation, norm, rotary

    weight = 1 + 0.1 * torch.randn(s.hidden, dtype=dtype, device=device)
    for tokens in s.token_counts:
        x = torch.randn(tokens, s.hidden, dtype=dtype, device=device)
        res = torch.randn_like(x)
        yield Case(
            "rms_norm",
            f"T={tokens} H={s.hidden}",
            lambda x=x: norm.rms_norm(x, weight, 1e-6),
            lambda x=x: rms_norm_ref(x, weight, 1e-6),
            2 * _nbytes(x),
            0.0,
        )
        yield Case(
            "fused_add_rms_norm",
            f"T={tokens} H={s.hidden}",
            lambda x=x, r=res: norm.fused_add_rms_norm(x, r, weight, 1e-6),
            lambda x=x, r=res: fused_add_rms_norm_ref(x, r, weight, 1e-6),
            4 * _nbytes(x),
            0.0,
        )

        q = torch.randn(tokens, s.heads, s.head_dim, dtype=dtype, device=device)
        k = torch.randn(tokens, s.kv_heads, s.head_dim, dtype=dtype, device=device)
        positions = torch.randint(0, 8192, (tokens,), device=device)
        inv_freq = 1.0 / 500000 ** (torch.arange(0, s.head_dim, 2, device=device) / s.head_dim)
        freqs = torch.outer(torch.arange(8192, device=device).float(), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        args = (positions, q, k, cache)
        yield Case(
            "apply_rotary",
            f"T={tokens} H={s.heads}/{s.kv_heads}",
            lambda a=args: rotary.apply_rotary(*a),
            lambda a=args: apply_rotary_ref(*a),
            2 * _nbytes(q, k) + tokens * s.head_dim * 4,
            0.0,
        )

        gate_up = torch.randn(tokens, 2 * s.inter, dtype=dtype, device=device)
        yield Case(
            "silu_and_mul",
            f"T={tokens} I={s.inter}",
            lambda x=gate_up: activation.silu_and_mul(x),
            lambda x=gate_up: silu_and_mul_ref(x),
            _nbytes(gate_up) * 3 // 2,
            0.0,
        )


def moe_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
    from pdmesh.kernels.triton import moe_experts, moe_route

    e, h, i = s.experts, s.moe_hidden, s.moe_inter
    w13 = torch.randn(e, 2 * i, h, dtype=dtype, device=device) / h**0.5
    w2 = torch.randn(e, h, i, dtype=dtype, device=device) / i**0.5
    expert_bytes = (_nbytes(w13) + _nbytes(w2)) / e
    for tokens in s.moe_tokens:
        # float32 router logits: random bf16 values tie often, and two top-k kernels may break a
        # tie differently, both correctly; ties in float32 are vanishingly rare.
        logits = torch.randn(tokens, e, dtype=torch.float32, device=device)
        yield Case(
            "moe_route",
            f"T={tokens} E={e} k={s.top_k}",
            lambda x=logits: moe_route.moe_route(x, s.top_k, True),
            lambda x=logits: moe_route_ref(x, s.top_k, True),
            _nbytes(logits) + tokens * s.top_k * 12,
            0.0,
        )
        weights, ids, _ = moe_route_ref(logits, s.top_k, True)
        x = torch.randn(tokens, h, dtype=dtype, device=device)
        hit = int(torch.unique(ids).numel())
        args = (x, w13, w2, weights, ids, 0)
        yield Case(
            "moe_experts",
            f"T={tokens} E={e} k={s.top_k} H={h} I={i}",
            lambda a=args: moe_experts.moe_experts(*a),
            lambda a=args: moe_experts_ref(*a),
            hit * expert_bytes + 2 * _nbytes(x),
            2.0 * tokens * s.top_k * 3 * h * i,
        )


def linear_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    from pdmesh.kernels.linear import linear_ref, silu_and_mul_linear_ref
    from pdmesh.kernels.triton import gemv

    x1 = torch.randn(1, max(k for _, k in s.projections), dtype=dtype, device=device)
    # Timed eagerly, as every case here: these kernels are short enough that Triton's launch from
    # Python sets their pace. The engine runs them only inside CUDA graphs (bench/gemv_gpu.py
    # times them that way).
    for n, k in s.projections:
        w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
        x = x1[:, :k].contiguous()
        yield Case(
            "linear",
            f"T=1 N={n} K={k}",
            lambda x=x, w=w: gemv.gemv(x, w),
            lambda x=x, w=w: linear_ref(x, w),
            _nbytes(w, x) + n * x.element_size(),
            2.0 * n * k,
        )
    gate_up = torch.randn(1, 2 * s.inter, dtype=dtype, device=device)
    down = torch.randn(s.hidden, s.inter, dtype=dtype, device=device) / s.inter**0.5
    yield Case(
        "silu_and_mul_linear",
        f"T=1 N={s.hidden} K={s.inter}",
        lambda: gemv.gemv(gate_up, down, gated=True),
        lambda: silu_and_mul_linear_ref(gate_up, down),
        _nbytes(down, gate_up) + s.hidden * gate_up.element_size(),
        2.0 * s.hidden * s.inter,
    )


def all_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    yield from attention_cases(s, dtype, device)
    yield from pointwise_cases(s, dtype, device)
    yield from linear_cases(s, dtype, device)
    yield from moe_cases(s, dtype, device)
