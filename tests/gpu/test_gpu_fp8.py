"""FP8 on a GPU: the W8A8 path against transformers running the same arithmetic, and the bf16
engine's batch-1 graphs on the fp8 GEMV. Skipped without CUDA."""

from __future__ import annotations

import pytest
from support import hf_greedy, random_prompts
from test_fp8_models import hf_fp8

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fp8_w8a8_on_cuda_matches_transformers(tiny_model, arch, monkeypatch) -> None:
    """fp32 activations, every projection W8A8 (the GEMV, weight-only, switched off): the Triton
    quantization and the emulated fp8 product give transformers' W8A8 tokens."""
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "0")
    folder = tiny_model(arch)
    prompts = random_prompts([5, 17, 40, 100])
    llm = LLM(str(folder), dtype="float32", quantization="fp8", kv_cache_tokens=4096)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    hf = hf_fp8(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24, ignore_eos=True)


def test_fp8_bf16_graphs_run_the_fp8_gemv_and_scaled_mm(tiny_model) -> None:
    """bf16: prefill on torch._scaled_mm, batch-1 decode steps on the fp8 GEMV inside graphs;
    the tokens agree with an eager engine (every step W8A8) on most positions (the GEMV keeps
    the activations in bf16, so a near tie may break the other way)."""
    from torch.profiler import ProfilerActivity, profile

    folder = str(tiny_model("llama"))
    prompts = random_prompts([5, 40, 100])
    graphs = LLM(folder, dtype="bfloat16", quantization="fp8", kv_cache_tokens=4096)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = [graphs.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
    kernels = {e.key for e in prof.key_averages()}
    assert any("_gemv_kernel" in k for k in kernels), sorted(kernels)
    assert any("_quantize_rows_kernel" in k for k in kernels), sorted(kernels)
    eager = LLM(
        folder, dtype="bfloat16", quantization="fp8", kv_cache_tokens=4096, enforce_eager=True
    )
    expected = [eager.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in prompts]
    same = sum(
        a == b
        for g, e in zip(got, expected, strict=True)
        for a, b in zip(g.outputs[0].token_ids, e.outputs[0].token_ids, strict=True)
    )
    assert same >= 0.8 * 24 * len(prompts), same
    assert all(
        g.outputs[0].token_ids[0] == e.outputs[0].token_ids[0]
        for g, e in zip(got, expected, strict=True)
    )  # the prefill's token: one path
