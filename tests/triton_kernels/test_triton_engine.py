"""The whole engine on the Triton kernels generates what it generates on the torch references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support import random_prompts

from pdmesh import LLM, SamplingParams


def _greedy(folder: Path, prompts: list[list[int]], **options: object) -> list[list[int]]:
    # float32 so that rounding cannot flip a near-tie between the two runs; chunked prefill
    # (32-token budget) so that chunks attend to pages their earlier chunks wrote.
    llm = LLM(
        str(folder), dtype="float32", kv_cache_tokens=512, max_num_batched_tokens=32, **options
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    ("arch", "quantization"), [("llama", None), ("qwen3_moe", None), ("qwen3_moe", "fp8")]
)
def test_greedy_tokens_match_the_torch_backend(
    arch: str,
    quantization: str | None,
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp8: per-token quantization and the fp8 MoE experts on Triton, W8A8 as the references
    (shorter prompts: the interpreter quantizes each row in a program of its own)."""
    folder = tiny_model(arch)
    prompts = random_prompts([9, 40, 23] if quantization is None else [11])
    if quantization is not None:  # the fp8 GEMV keeps activations unquantized: W8A8 throughout
        monkeypatch.setenv("PDMESH_GEMV_MAX_ROWS", "0")
    monkeypatch.setenv("PDMESH_KERNEL_BACKEND", "torch")
    expected = _greedy(folder, prompts, quantization=quantization)
    monkeypatch.setenv("PDMESH_KERNEL_BACKEND", "triton")
    assert _greedy(folder, prompts, quantization=quantization) == expected
