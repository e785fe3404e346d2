"""The embedded default model (SmolLM2-135M-Instruct) against transformers, token for token."""

from __future__ import annotations

import pytest
from support import hf_greedy_along, load_hf
from transformers import PreTrainedTokenizerBase

from pdmesh import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1492,",
    "Once upon a time there was a dragon who lived in a cave near the village, and every night "
    "it flew over the houses looking for",
    "1 2 3 4 5",
    "The meaning of life is",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of",
    "Q: What is two plus two?\nA:",
]


@pytest.fixture(scope="module")
def llm(default_llm: LLM) -> LLM:
    return default_llm


def test_batched_greedy_matches_transformers(llm: LLM, default_model_folder) -> None:
    params = SamplingParams(max_tokens=32, temperature=0)
    outputs = llm.generate(PROMPTS, params)
    hf = load_hf(default_model_folder)
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase)  # Hugging Face's, as vLLM's LLM returns
    assert len({len(tok.encode(p)) for p in PROMPTS}) >= 6  # really of different lengths
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        got = out.outputs[0].token_ids
        assert got == hf_greedy_along(hf, tok.encode(prompt), got, 32, ignore_eos=False), prompt
        assert out.prompt_token_ids == tok.encode(prompt)
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>, not at the length cap
    assert "<|im_end|>" not in out.outputs[0].text
