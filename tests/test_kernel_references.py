"""The torch reference kernels against plain dense math (float64) and transformers' modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_cache_ref,
)
from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
from pdmesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from pdmesh.kernels.rotary import apply_rotary_ref

BS = 16


def _dense_attention(q, k, v, q_positions, scale):
    # q: [q_len, H, D], k/v: [ctx, Hkv, D], float64; causal by absolute position.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _paged(contexts, num_kv_heads, head_dim, num_blocks=64, seed=0):
    """Random per-sequence K/V scattered into pages through shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, BS, num_kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for ctx in contexts:
        tables.append([free.pop() for _ in range(-(-ctx // BS))])
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv = []
    for ctx, t in zip(contexts, tables, strict=True):
        k = k_cache[t].flatten(0, 1)[:ctx]
        v = v_cache[t].flatten(0, 1)[:ctx]
        kv.append((k.double(), v.double()))
    return k_cache, v_cache, table_t, kv


# A batch above DECODE_GROUP is attended in groups of similar length: same results, any order.
MIXED = [70, 3, 33, 1, 64, 17, 90, 16, 5, 48, 81, 2, 29, 15, 77, 40, 9, 56, 100]


@pytest.mark.parametrize("contexts", [[1, 15, 16, 17, 100], MIXED], ids=["batch5", "batch19"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)])
def test_paged_decode_matches_dense(heads: int, kv_heads: int, contexts: list[int]) -> None:
    k_cache, v_cache, tables, kv = _paged(contexts, kv_heads, 32, num_blocks=160)
    q = torch.randn(len(contexts), heads, 32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 32**-0.5)
    for i, ctx in enumerate(contexts):
        ref = _dense_attention(q[i : i + 1].double(), *kv[i], torch.tensor([ctx - 1]), 32**-0.5)
        torch.testing.assert_close(out[i].double(), ref[0], rtol=1e-5, atol=1e-5)


def test_paged_prefill_with_cached_prefix_matches_dense() -> None:
    contexts, q_lens = [40, 16, 33], [40, 3, 17]  # first: fresh prompt; others: prefix cached
    k_cache, v_cache, tables, kv = _paged(contexts, 2, 16)
    cu = torch.tensor([0, 40, 43, 60], dtype=torch.int32)
    q = torch.randn(60, 6, 16)
    out = paged_prefill_attention_ref(
        q, k_cache, v_cache, cu, torch.tensor(contexts, dtype=torch.int32), tables, 0.25
    )
    for i, (ctx, ql) in enumerate(zip(contexts, q_lens, strict=True)):
        qi = q[cu[i] : cu[i + 1]].double()
        ref = _dense_attention(qi, *kv[i], torch.arange(ctx - ql, ctx), 0.25)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), ref, rtol=1e-5, atol=1e-5)


def test_store_kv_cache_writes_slots_and_skips_padding() -> None:
    k_cache = torch.full((4, BS, 2, 8), -7.0)
    v_cache = torch.full((4, BS, 2, 8), -7.0)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_cache_ref(key, value, k_cache, v_cache, torch.tensor([5, -1, 2 * BS + 3]))
    assert torch.equal(k_cache[0, 5], key[0]) and torch.equal(v_cache[2, 3], value[2])
    assert int((k_cache != -7.0).sum()) == 2 * 2 * 8  # the -1 token wrote nothing


def test_rotary_matches_transformers_llama3() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from pdmesh.bench.gpu_models import llama3_rope
    from pdmesh.engine.layers.rotary import RotaryEmbedding

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters=llama3_rope(original_max_positions=64),
    )
    positions = torch.tensor([0, 1, 7, 63, 64, 300, 511])
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    ours = RotaryEmbedding(config, 64, 512)
    got_q, got_k = apply_rotary_ref(positions, q, k, ours.cos_sin_cache)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_rms_norm_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    x, residual = torch.randn(10, 64), torch.randn(10, 64)
    torch.testing.assert_close(rms_norm_ref(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)
    normed, new_residual = fused_add_rms_norm_ref(x, residual, hf.weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, hf(x + residual), rtol=0, atol=0)


def test_silu_and_mul() -> None:
    x = torch.randn(5, 16)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(x[:, :8]) * x[:, 8:])


@pytest.mark.parametrize(("top_k", "renormalize", "first_expert"), [(2, True, 0), (1, False, 2)])
def test_moe_matches_dense_per_token(top_k: int, renormalize: bool, first_expert: int) -> None:
    num_experts, local, hidden, inter = 6, 3, 16, 8
    x = torch.randn(20, hidden, dtype=torch.float64)
    w13 = torch.randn(local, 2 * inter, hidden, dtype=torch.float64)
    w2 = torch.randn(local, hidden, inter, dtype=torch.float64)
    logits = torch.randn(20, num_experts, dtype=torch.float64)
    weights, ids, _ = moe_route_ref(logits, top_k, renormalize)
    probs = logits.softmax(-1)
    torch.testing.assert_close(
        weights,
        probs.gather(1, ids) / (probs.gather(1, ids).sum(-1, keepdim=True) if renormalize else 1),
        check_dtype=False,  # routing weights are float32 by contract
    )
    out = moe_experts_ref(x, w13, w2, weights.double(), ids, first_expert)
    for t in range(20):
        ref = torch.zeros(hidden, dtype=torch.float64)
        for slot in range(top_k):
            e = int(ids[t, slot]) - first_expert
            if 0 <= e < local:  # experts held by this rank only
                gate, up = (w13[e] @ x[t]).chunk(2)
                ref += weights[t, slot] * (w2[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(out[t], ref)
