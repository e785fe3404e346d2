"""Prefix caching: shared prefixes reuse cached blocks (counted) and change no output."""

from __future__ import annotations

from support import random_prompts

from pdmesh import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_shared_64_token_prefix_reuses_blocks(tiny_model) -> None:
    folder = str(tiny_model("qwen3"))
    prefix, tail_a, tail_b = random_prompts([64, 10, 23], seed=7)
    first, second = prefix + tail_a, prefix + tail_b

    llm = LLM(folder, kv_cache_tokens=2048, block_size=16)
    out_first = llm.generate([{"prompt_token_ids": first}], PARAMS)[0]
    assert out_first.num_cached_tokens == 0
    hits_before = llm.engine.stats().prefix_hit_tokens
    out_second = llm.generate([{"prompt_token_ids": second}], PARAMS)[0]
    assert out_second.num_cached_tokens == 64  # 4 full blocks of the shared prefix
    assert llm.engine.stats().prefix_hit_tokens - hits_before == 64

    fresh = LLM(folder, kv_cache_tokens=2048, enable_prefix_caching=False)
    expected = fresh.generate([{"prompt_token_ids": second}], PARAMS)[0]
    assert out_second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert fresh.engine.stats().prefix_hit_tokens == 0
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_whole_prompt_cached_still_samples(tiny_model) -> None:
    """A prompt that is entirely cached recomputes its last token to have logits to sample."""
    folder = str(tiny_model("llama"))
    (prompt,) = random_prompts([48], seed=3)  # exactly 3 blocks
    llm = LLM(folder, kv_cache_tokens=1024)
    a = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    b = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    assert b.num_cached_tokens == 32  # all but the last block: one token must be computed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
