"""Log-probabilities of sampled tokens (`SamplingParams(logprobs=k)`) against transformers'
log-softmax, in fp32: the chosen token's value and rank, and the top-k alternatives."""

from __future__ import annotations

import math

import pytest
import torch
from support import load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.errors import InvalidRequest

K = 5


def _reference(hf: object, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: [len(output), V]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


@pytest.mark.parametrize("layout", [{}, {"pipeline_parallel_size": 2}], ids=["pp1", "pp2"])
def test_logprobs_match_transformers(tiny_model, layout: dict[str, int]) -> None:
    folder = tiny_model("llama")
    prompts = random_prompts([5, 17, 40], seed=4)
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=K),
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=K),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=9, ignore_eos=True, logprobs=0),
    ]
    with LLM(str(folder), kv_cache_tokens=1024, **layout) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        plain = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))
    assert plain[0].outputs[0].logprobs is None  # not asked for: not computed
    hf = load_hf(folder)
    for prompt, out, p in zip(prompts, outputs, params, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None and len(completion.logprobs) == 6
        ref = _reference(hf, prompt, completion.token_ids)
        total = 0.0
        pairs = zip(completion.token_ids, completion.logprobs, strict=True)
        for row, (token, entry) in zip(ref, pairs, strict=True):
            chosen = entry[token]
            assert math.isclose(chosen.logprob, row[token].item(), abs_tol=1e-4)
            assert chosen.rank == int((row > row[token]).sum()) + 1
            if p.greedy:
                assert chosen.rank == 1
            top = row.topk(p.logprobs)
            others = {t: lp for t, lp in entry.items() if lp.rank <= p.logprobs}
            assert len(entry) in (p.logprobs, p.logprobs + 1)  # + the chosen one if not in top k
            if p.logprobs:
                assert sorted(others) == sorted(top.indices.tolist())
                for t, lp in others.items():
                    assert math.isclose(lp.logprob, row[t].item(), abs_tol=1e-4)
            assert isinstance(chosen.decoded_token, str)
            total += chosen.logprob
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_logprobs_are_refused_naming_the_field(value: object) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest, match=name) as caught:
            SamplingParams(**{name: value})
        assert caught.value.field == name


@pytest.mark.parametrize("layout", [{}, {"pipeline_parallel_size": 2}], ids=["pp1", "pp2"])
def test_prompt_logprobs_match_transformers_across_chunks(tiny_model, layout) -> None:
    """Every prompt position, across chunked prefill (a 32-token budget), also for a prompt
    the prefix cache holds (a request asking for them skips the cache and recomputes)."""
    folder = tiny_model("llama")
    shared = random_prompts([70], seed=8)[0]
    prompts = [shared, [*shared, 5, 6, 7], random_prompts([9], seed=2)[0]]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with LLM(str(folder), kv_cache_tokens=1024, max_num_batched_tokens=32, **layout) as llm:
        llm.generate({"prompt_token_ids": shared}, SamplingParams(max_tokens=1))  # cached now
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.num_cached_tokens == 0
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
        ref = torch.log_softmax(logits, dim=-1)
        for pos in range(1, len(prompt)):
            entry, row, token = got[pos], ref[pos - 1], prompt[pos]
            assert entry is not None and math.isclose(
                entry[token].logprob, row[token].item(), abs_tol=1e-4
            )
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = {t for t, lp in entry.items() if lp.rank <= 3}
            assert top == set(row.topk(3).indices.tolist())
