"""Sampling: seeds, top-k / top-p, temperature statistics, stop strings and stop ids."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.sample.sampler import (
    Sampler,
    SamplingBatch,
    filter_top_k_top_p,
    filter_top_k_top_p_sorted,
)

PROMPT = "Write a short poem about the sea:"


def test_seeded_sampling_is_reproducible_whatever_the_batch(default_llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234)
    alone = default_llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    # The same request among unseeded neighbours, in another position.
    others = SamplingParams(max_tokens=24, temperature=1.0)
    batch = default_llm.generate(["Hi", PROMPT, "Tell me"], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=4321)
    assert default_llm.generate([PROMPT], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(default_llm: LLM) -> None:
    greedy = default_llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))
    top_k = default_llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1, top_k=1))
    top_p = default_llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1, top_p=1e-6))
    ids = greedy[0].outputs[0].token_ids
    assert top_k[0].outputs[0].token_ids == ids
    assert top_p[0].outputs[0].token_ids == ids


def test_stop_string_ends_generation_and_is_not_in_text(default_llm: LLM) -> None:
    full = default_llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0))[0]
    text = full.outputs[0].text
    words = text.split()
    assert len(words) > 6
    stop = words[4]
    cut = text.index(stop)
    out = default_llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text == text[:cut]
    assert len(out[0].outputs[0].token_ids) < len(full.outputs[0].token_ids)


def test_stop_token_id_ends_generation(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama")), kv_cache_tokens=1024)
    (prompt,) = random_prompts([12], seed=5)
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = llm.generate([{"prompt_token_ids": prompt}], base)[0].outputs[0].token_ids
    stop_at = ids[5]
    first = ids.index(stop_at)
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at])
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[: first + 1]  # the stop token is reported, not its text
    assert not out.text.endswith(f"t{stop_at}")
    length = llm.generate([{"prompt_token_ids": prompt}], base)[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 20


def _batch(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    return SamplingBatch.build(params, [None] * len(params), vocab, torch.device("cpu"))


def test_temperature_sampling_follows_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=0.7)] * logits.shape[0]
    tokens = Sampler(seed=0)(logits, _batch(params, 4))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_greedy_rows_beside_sampled_ones_take_their_argmax() -> None:
    """A batch of greedy and sampled rows: the greedy ones get the largest logit, the sampled
    ones draw (a flat row's draws spread over its tokens)."""
    logits = torch.zeros(400, 8)
    logits[:, 5] = 0.01  # the argmax, by a hair
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(400)]
    tokens = Sampler(seed=0)(logits, _batch(params, 8))
    assert (tokens[1::2] == 5).all()
    assert len(set(tokens[0::2].tolist())) == 8


def test_a_skipped_draw_is_what_a_sampled_token_takes_from_its_seed() -> None:
    """A token drawn elsewhere (a prefill worker's first token, a resumed request's output) is
    skipped with `skip_draw`: the generator then stands where sampling that token left it, so
    the rest of the request matches a single-worker run."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=9)] * 3
    sampled = [torch.Generator().manual_seed(9) for _ in range(3)]
    Sampler()(logits, SamplingBatch.build(params, sampled, 50, torch.device("cpu")))
    skipped = torch.Generator().manual_seed(9)
    Sampler.skip_draw(skipped)  # each row's generator made one draw
    assert all(torch.equal(g.get_state(), skipped.get_state()) for g in sampled)


def test_sampling_never_picks_a_token_of_probability_zero() -> None:
    """The inverse transform over the cumulative probabilities: masked tokens (-inf), however
    many and wherever they lie, are never drawn, the last token included."""
    logits = torch.full((4000, 40), float("-inf"))
    logits[:, [0, 17, 39]] = torch.tensor([0.0, 1.0, -1.0])
    params = [SamplingParams(temperature=1.0)] * logits.shape[0]
    tokens = Sampler(seed=3)(logits, _batch(params, 40))
    assert set(tokens.tolist()) == {0, 17, 39}


def test_filters_from_the_largest_logits_equal_those_from_a_full_sort() -> None:
    """On the CPU the top-k / top-p filters first look at each row's largest logits only; rows
    mixing every setting (top-k alone, top-p alone, both, a top-k wider than the first
    candidates, a flatter row whose top-p needs the wider set, a nearly uniform one whose top-p
    needs more than every candidate set: the whole sort) keep exactly the tokens, and the
    logits, that a sort of the whole vocabulary keeps."""
    g = torch.Generator().manual_seed(5)
    vocab = 12000
    scales = torch.tensor([8, 8, 8, 8, 8, 0.05, 8, 2])[:, None]
    logits = torch.randn(8, vocab, generator=g) * scales
    top_k = torch.tensor([40, vocab, 3, 300, vocab, vocab, 1, vocab])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.3, 0.95, 1.0, 0.9])
    # The first 256 candidates; the 4,096 (the last row's top-p needs more than 256); the sort.
    for rows in ([0, 1, 2, 3, 4, 6], [0, 1, 7], list(range(8))):
        got = filter_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
        want = filter_top_k_top_p_sorted(logits[rows], top_k[rows], top_p[rows])
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
        assert (~torch.isinf(got)).sum(dim=-1).min() >= 1


@pytest.mark.parametrize(("top_k", "top_p", "allowed"), [(2, 1.0, {0, 1}), (0, 0.8, {0, 1})])
def test_filters_never_sample_outside_their_set(top_k: int, top_p: float, allowed: set) -> None:
    # softmax([3, 2.5, 0, 0]) ~ [0.58, 0.35, 0.03, 0.03]: top_p 0.8 keeps the first two.
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]]).repeat(5000, 1)
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * logits.shape[0]
    tokens = set(Sampler(seed=1)(logits, _batch(params, 4)).tolist())
    assert tokens == allowed
