"""Speculative decoding in the mesh's decode worker: `pdmesh up --speculative-config ...`
streams the tokens an engine without speculation makes (itself checked against transformers in
test_default_model.py), for prompts prefilled remotely and locally."""

from __future__ import annotations

import asyncio
import json

from mesh_support import greedy_tokens, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.bench.speculative import SNIPPETS

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def test_greedy_through_the_mesh_equals_speculation_off(default_llm: LLM) -> None:
    tokenizer = default_llm.engine.tokenizer
    assert tokenizer is not None
    prompts = [
        tokenizer.encode(f"Copy this code:\n{code}\nThe copy:\n{code[:60]}") for code in SNIPPETS
    ]
    prompts.append(tokenizer.encode("a b c a b c a b"))  # short: prefilled on the decode worker
    mesh = start_mesh(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-cache-tokens",
        "8192",
        "--disagg-min-tokens",
        "32",
        "--speculative-config",
        json.dumps(SPEC),
    )
    try:
        got = asyncio.run(greedy_tokens(mesh.target, prompts, 24))
        stats = mesh.stats(mesh.decode[0])
    finally:
        mesh.stop()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = default_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert got == [w.outputs[0].token_ids for w in want]
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens  # it did speculate
    assert stats.remote_prefills == len(SNIPPETS) and stats.local_prefills == 1
    assert stats.kv_blocks_used == 0
