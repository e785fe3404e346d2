"""FP8 on a GPU: the W8A8 path against transformers running the same arithmetic, and the bf16
engine's batch-1 graphs on the fp8 GEMV. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts
from test_fp8_models import hf_fp8

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# The largest top-2 logit gap at which GPU and CPU summation orders may pick different tokens:
# a difference in the last bits of an activation can move one of its fp8 roundings (a 6% step
# of that element), so W8A8 greedy paths may part at near ties where fp32 ones would not.
NEAR_TIE = 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_fp8_w8a8_on_cuda_matches_transformers(tiny_model, arch, monkeypatch) -> None:
    """fp32 activations, every projection W8A8 (the GEMV, weight-only, switched off): the Triton
    quantization and the emulated fp8 product give transformers' W8A8 tokens, up to where the
    two first part, which must be a near tie in transformers' logits."""
    monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "0")
    folder = tiny_model(arch)
    prompts = random_prompts([5, 17, 40, 100])
    llm = LLM(str(folder), dtype="float32", quantization="fp8", kv_cache_tokens=4096)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    hf = hf_fp8(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 :].float()
        for i, token in enumerate(ours):
            best = int(logits[i].argmax())
            if token != best:  # the first parting: a near tie, after which the paths differ
                gap = float(logits[i, best] - logits[i, token])
                assert gap < NEAR_TIE, (i, gap)
                break


def test_fp8_bf16_graphs_run_the_fp8_gemv_and_scaled_mm(tiny_model) -> None:
    """bf16: prefill on the per-token quantization and torch._scaled_mm, batch-1 decode steps on
    the fp8 GEMV inside graphs (its numerics: tests/triton_kernels/test_triton_fp8.py). The
    prefill's token is the eager engine's (the same W8A8 path); graph replays are repeatable."""
    from torch.profiler import ProfilerActivity, profile

    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 40, 100])]
    graphs = LLM(folder, dtype="bfloat16", quantization="fp8", kv_cache_tokens=4096)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = [graphs.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    kernels = {e.key for e in prof.key_averages()}
    assert any("_gemv_kernel" in k for k in kernels), sorted(kernels)
    assert any("_quantize_rows_kernel" in k for k in kernels), sorted(kernels)
    assert [graphs.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts] == got
    eager = LLM(
        folder, dtype="bfloat16", quantization="fp8", kv_cache_tokens=4096, enforce_eager=True
    )
    expected = [eager.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(len(g) == 24 for g in got)
