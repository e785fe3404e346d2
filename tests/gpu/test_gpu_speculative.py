"""Speculative decoding on a GPU: verify steps eager beside CUDA-graph decode steps, async
scheduling standing aside while drafts are proposed. Skipped without CUDA (passed on an H100,
2026-11-25)."""

from __future__ import annotations

import pytest
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_fp32_speculation_on_cuda_matches_transformers(tiny_model) -> None:
    folder = tiny_model("llama")
    a, b = random_prompts([7, 5], seed=11)
    prompts = [a * 4, b * 6 + a, a + b + a + b + a]
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=4096, speculative_config=SPEC)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32, ignore_eos=True)
    stats = llm.engine.speculator.stats
    assert 0 < stats.accepted <= stats.proposed
    # One sequence past the threshold: plain decode steps, launched ahead on graphs.
    many = random_prompts([9] * 12, seed=3)
    crowd = LLM(
        str(folder),
        dtype="float32",
        kv_cache_tokens=4096,
        speculative_config={**SPEC, "disable_by_batch_size": 4},
    )
    outs = crowd.generate([{"prompt_token_ids": p} for p in many], GREEDY)
    assert crowd.engine.steps_launched_ahead > 0
    for prompt, out in zip(many[:3], outs[:3], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32, ignore_eos=True)
