"""Attention over the paged KV cache for a flat batch of decodes and prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdmesh.kernels import paged_decode_attention, paged_prefill_attention, rotary_and_store_kv


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch reads and writes KV.

    The first `num_decode_tokens` tokens are single-token steps (one per sequence); the rest are
    prefill chunks, sequence after sequence.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot each token's K/V is written to
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor  # [D] int32
    max_decode_context_len: int
    prefill_cu_seqlens: torch.Tensor  # [P+1] int32: query offsets within the prefill part
    prefill_context_lens: torch.Tensor  # [P] int32
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    max_prefill_query_len: int
    max_prefill_context_len: int


@dataclass(frozen=True)
class QKPrologue:
    """What q and k go through before attention: per-head RMSNorm (Qwen3's q_norm / k_norm
    weights; None: none), then rotary embedding at `positions` from `cos_sin_cache`. Attention
    runs it together with storing K and V (one kernel on GPUs: kernels/prologue.py)."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_pos, rot_dim] float32
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None
    eps: float = 0.0


class Attention(nn.Module):
    """Stores this step's K/V in the cache, then attends over each sequence's pages.

    `k_cache`/`v_cache` ([num_blocks, block_size, Hkv, D]) are bound by the model runner once the
    cache is allocated. An fp8 cache (`kv_cache_dtype="fp8"`) holds K / k_scale and V / v_scale:
    one scale per layer for each, 1.0 as vLLM's default for uncalibrated models. They are fixed
    for the life of the weights, so every worker, the host tier and the KV store agree on what a
    stored byte means and blocks move as bytes (docs/kv-cache.md says why 1.0).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        prologue: QKPrologue,
    ) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D], before the prologue's norms and rotary -> [T, H * D]
        p = prologue
        q = rotary_and_store_kv(
            p.positions, q, k, v, p.cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping,
            q_norm=p.q_norm, k_norm=p.k_norm, eps=p.eps, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        return self._attend(q, meta)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H, D] -> [T, H * D], over the pages the KV cache holds
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            out = self._decode(q, meta)
        elif nd == 0:
            out = self._prefill(q, meta)
        else:
            out = torch.cat((self._decode(q[:nd], meta), self._prefill(q[nd:], meta)))
        return out.flatten(1)

    @torch.inference_mode()
    def warm_up(self, dtype: torch.dtype, max_context_len: int) -> None:
        """Attend a mixed step of one decode and one prefill row twice, storing nothing: first as
        a short step (the decode written directly, the prefill's small query tile), then as a
        long one (the decode in splits, the large tile). Every variant of the attention kernels
        a step can launch is compiled before the first request, not in the middle of a step (a
        Triton compile held rank 0's host for 0.5-0.7 s on an H100, with pipeline stages every
        rank's too)."""
        device = self.k_cache.device
        i32 = {"dtype": torch.int32, "device": device}
        q = torch.zeros(2, self.num_heads, self.head_dim, dtype=dtype, device=device)
        table, one = torch.zeros(1, 1, **i32), torch.ones(1, **i32)
        # (The prologue and the KV store compile in the engine's warm-up step, which has the
        # model's rotary table and norms: engine/warm_up.py.)
        # The split count and the query tile follow the step's longest context and query.
        for longest in (1, max_context_len):
            meta = AttentionMetadata(
                slot_mapping=torch.full((2,), -1, dtype=torch.int64, device=device),
                num_decode_tokens=1,
                decode_block_tables=table,
                decode_context_lens=one,
                max_decode_context_len=longest,
                prefill_cu_seqlens=torch.tensor([0, 1], **i32),
                prefill_context_lens=one,
                prefill_block_tables=table,
                max_prefill_query_len=longest,  # the kernel reads each row's own length
                max_prefill_context_len=1,
            )
            self._attend(q, meta)

    def _decode(self, q: torch.Tensor, m: AttentionMetadata) -> torch.Tensor:
        k, v, scale = self.k_cache, self.v_cache, self.scale
        tables, lens = m.decode_block_tables, m.decode_context_lens
        return paged_decode_attention(
            q,
            k,
            v,
            tables,
            lens,
            scale,
            m.max_decode_context_len,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def _prefill(self, q: torch.Tensor, m: AttentionMetadata) -> torch.Tensor:
        k, v, scale = self.k_cache, self.v_cache, self.scale
        cu, lens, tables = m.prefill_cu_seqlens, m.prefill_context_lens, m.prefill_block_tables
        max_q, max_ctx = m.max_prefill_query_len, m.max_prefill_context_len
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return paged_prefill_attention(q, k, v, cu, lens, tables, scale, max_q, max_ctx, **scales)
