"""An fp8 KV cache on a GPU: the Triton store and attention kernels over fp8 pages (inside the
decode CUDA graphs) against a bf16 cache on the default model's real weights. Skipped without
CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh import LLM, SamplingParams
from pdmesh.kernels import paged_decode_attention
from pdmesh.kernels.attention import paged_decode_attention_ref
from pdmesh.kernels.kv_quant import FP8_KV_DTYPE, dequantize, quantize

pytestmark = pytest.mark.gpu


def test_triton_decode_over_fp8_pages_matches_bf16_pages_holding_the_same_values() -> None:
    """bf16 queries, 4,096-token contexts, flash-decoding splits: the kernel over fp8 pages with
    scales equals the same kernel over bf16 pages holding the dequantized values (exact in
    bf16), and the torch reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, kv_heads, dim, bs, ctx = 8, 32, 8, 128, 16, 4096
    blocks = batch * ctx // bs
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=g) * 3
    v = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=g) * 3
    k8, v8 = quantize(k, FP8_KV_DTYPE, 0.5), quantize(v, FP8_KV_DTYPE, 2.0)
    kb, vb = dequantize(k8, torch.bfloat16, 0.5), dequantize(v8, torch.bfloat16, 2.0)
    tables = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    got = paged_decode_attention(q, k8, v8, tables, lens, dim**-0.5, ctx, k_scale=0.5, v_scale=2.0)
    want = paged_decode_attention(q, kb, vb, tables, lens, dim**-0.5, ctx)
    ref = paged_decode_attention_ref(q, kb, vb, tables, lens, dim**-0.5, ctx)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fp8_cache_decode_agrees_with_bf16_cache_on_the_default_model() -> None:
    """Graphs on, bf16 model: the fp8 cache's greedy tokens and next-token choices against the
    bf16 cache's, on the README's text (the CPU figure: BENCHMARKS.md, "An fp8 KV cache")."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    chat = [[{"role": "user", "content": "What is the capital of France?"}]]
    tops = {}
    for kv in ("auto", "fp8"):
        with LLM(kv_cache_tokens=8192, kv_cache_dtype=kv) as llm:
            assert llm.engine.runner.graphs is not None
            assert (llm.engine.runner.kv_cache.data.dtype == FP8_KV_DTYPE) == (kv == "fp8")
            answer = llm.chat(chat, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
            assert "Paris" in answer[0].outputs[0].text
            ids = llm.get_tokenizer().encode(readme.read_text())[:1024]
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            tops[kv] = [
                next(t for t, lp in p.items() if lp.rank == 1) for p in out.prompt_logprobs[1:]
            ]
    agreement = sum(a == b for a, b in zip(tops["auto"], tops["fp8"], strict=True)) / 1023
    assert agreement >= 0.95, f"next-token agreement {agreement:.1%}"
