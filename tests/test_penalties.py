"""Presence, frequency and repetition penalties, logit_bias and min_tokens, as vLLM defines them:
greedy outputs against transformers' logits shaped by the same rules, token for token."""

from __future__ import annotations

import pytest
import torch
from support import load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.errors import InvalidRequest

N = 12


def _shaped_greedy(hf: object, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding of `hf` with the penalties applied by hand, one token at a time."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float()  # type: ignore[operator]
        seen = set(prompt) | set(out)
        for t in seen:
            if p.repetition_penalty != 1:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(out):
            x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
        if len(out) < p.min_tokens:
            x[list(p.stop_token_ids)] = float("-inf")
        out.append(int(x.argmax()))
        if out[-1] in p.stop_token_ids and len(out) >= p.min_tokens:
            break
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence-frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "bias": dict(logit_bias={3: 4.0, 7: -100.0}, repetition_penalty=0.8),
    "min-tokens": dict(logit_bias={11: 100.0}, stop_token_ids=[11], min_tokens=3),
}


def test_penalties_match_a_reference_over_transformers(tiny_model) -> None:
    folder = tiny_model("llama")
    prompts = random_prompts([6, 25], seed=5)
    params = {
        name: SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw)
        for name, kw in CASES.items()
    }
    hf = load_hf(folder)
    with LLM(str(folder), kv_cache_tokens=1024) as llm:
        plain = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
        )
        for name, p in params.items():
            outputs = llm.generate([{"prompt_token_ids": x} for x in prompts], [p] * len(prompts))
            for prompt, out, base in zip(prompts, outputs, plain, strict=True):
                got = out.outputs[0].token_ids
                assert got == _shaped_greedy(hf, prompt, p), name
                assert got != base.outputs[0].token_ids, name  # the rule changed something
    # min_tokens: the stop token (biased to be the likeliest) comes right after 3 tokens.
    assert len(got) == 4 and got[-1] == 11 and 11 not in got[:3]


def test_penalties_with_async_scheduling_give_the_same_tokens(tiny_model) -> None:
    """A step is not launched ahead of tokens its penalties must count."""
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([8, 30], seed=6)]
    p = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    with LLM(folder, kv_cache_tokens=1024) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    with LLM(folder, kv_cache_tokens=1024, async_scheduling=True) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field
