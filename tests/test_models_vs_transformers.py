"""Tiny random Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE models against transformers, with
chunked prefill and a KV pool small enough to force preemption."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import (
    TINY_ARCHS,
    hf_greedy,
    hf_greedy_along,
    load_hf,
    make_tiny_model,
    random_prompts,
)

from pdmesh import LLM, SamplingParams

# Several prompts longer than the 64-token step budget: they are prefilled in chunks.
LENGTHS = [5, 17, 40, 100, 150, 3, 64, 90]
NEW_TOKENS = 24


def _check_against_hf(folder, llm: LLM, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS, ignore_eos=True)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_with_chunking_and_preemption(tiny_model, arch: str) -> None:
    folder = tiny_model(arch)
    # 24 blocks of 16 = 384 tokens for 8 requests of up to 174 tokens: preemption is certain.
    llm = LLM(str(folder), kv_cache_tokens=384, max_num_batched_tokens=64, max_model_len=256)
    _check_against_hf(folder, llm, random_prompts(LENGTHS))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    counts = llm.engine.runner.expert_counts()
    if arch in ("mixtral", "qwen3_moe"):
        assert counts is not None and sum(counts) > 0 and min(counts) >= 0
    else:
        assert counts is None


def test_sharded_checkpoint_loads(tmp_path) -> None:
    folder = make_tiny_model(tmp_path / "sharded", "llama", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    llm = LLM(str(folder), kv_cache_tokens=1024)
    _check_against_hf(folder, llm, random_prompts([7, 33]))


def test_experts_stacked_as_in_transformers_5(tmp_path) -> None:
    """A checkpoint whose experts are stacked tensors ([E, 2I, H] / [E, H, I]) loads too."""
    folder = make_tiny_model(tmp_path / "moe", "mixtral")
    weights = load_file(folder / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(2):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        w1 = [weights.pop(f"{pre}.{e}.w1.weight") for e in range(4)]
        w3 = [weights.pop(f"{pre}.{e}.w3.weight") for e in range(4)]
        w2 = [weights.pop(f"{pre}.{e}.w2.weight") for e in range(4)]
        stacked[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat(p) for p in zip(w1, w3, strict=True)]
        )
        stacked[f"{pre}.down_proj"] = torch.stack(w2)
    per_expert = LLM(str(folder), kv_cache_tokens=1024)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 30])]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in per_expert.generate(prompts, params)]
    save_file({**weights, **stacked}, folder / "model.safetensors", metadata={"format": "pt"})
    got = LLM(str(folder), kv_cache_tokens=1024).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_the_one_forward_reference_is_transformers_greedy(tiny_model) -> None:
    """`hf_greedy_along` (one forward over the tokens to check) agrees with `generate` where the
    tokens are its own, and names transformers' choice where they part or stop early."""
    hf = load_hf(tiny_model("llama"))
    for prompt in random_prompts([5, 40]):
        want = hf_greedy(hf, prompt, NEW_TOKENS, ignore_eos=True)
        assert hf_greedy_along(hf, prompt, want, NEW_TOKENS, ignore_eos=True) == want
        wrong = [*want[:7], (want[7] + 1) % 512, *want[8:]]
        assert hf_greedy_along(hf, prompt, wrong, NEW_TOKENS, ignore_eos=True) == want[:8]
        assert hf_greedy_along(hf, prompt, want[:10], NEW_TOKENS, ignore_eos=True) == want[:11]
