"""n > 1 and best_of: one prefill whose blocks the choices share (the partly filled last block
copied on write on every rank), choice i seeded with seed + i, the n best of best_of by
cumulative log-probability, every block free afterwards, and refusals naming the field."""

from __future__ import annotations

import pytest
from support import random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import CompletionOutput, FirstTokens, RequestOutput
from pdmesh.errors import InvalidRequest

BLOCK = 16
SEED = 1234


def _params(**kw: object) -> SamplingParams:
    base: dict[str, object] = dict(max_tokens=12, temperature=1.0, seed=SEED, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def _separate(llm: LLM, prompt: list[int], n: int, **kw: object) -> list[list[int]]:
    """The same prompt as n requests of their own, seeded seed .. seed + n - 1."""
    return [c.token_ids for c in _separate_outputs(llm, prompt, n, **kw)]


def _separate_outputs(llm: LLM, prompt: list[int], n: int, **kw: object) -> list[CompletionOutput]:
    params = [_params(seed=SEED + i, **kw) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    return [o.outputs[0] for o in outs]


def _choices(out: RequestOutput) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


def _all_free(engine: LLMEngine) -> bool:
    s = engine.stats()
    return s.kv_blocks_used == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.fixture(scope="module")
def llm(tiny_model):
    """Chunks of 24 tokens: a long prompt is prefilled over several steps before it forks."""
    folder = str(tiny_model("llama"))
    with LLM(folder, kv_cache_tokens=2048, max_num_batched_tokens=24, max_num_seqs=16) as llm:
        yield llm


# A prompt of whole blocks (each choice's first token needs a new block) and two that end
# mid-block (the shared last block is copied on write), one of them over several chunks.
@pytest.mark.parametrize("length", [2 * BLOCK, 21, 53])
def test_n_equals_separate_requests_with_derived_seeds(llm: LLM, length: int) -> None:
    (prompt,) = random_prompts([length], seed=length)
    separate = _separate_outputs(llm, prompt, 4)
    expected = [c.token_ids for c in separate]
    before = llm.engine.fork_stats()
    (out,) = llm.generate({"prompt_token_ids": prompt}, _params(n=4))
    after = llm.engine.fork_stats()
    assert _choices(out) == expected
    assert [c.text for c in out.outputs] == [c.text for c in separate]  # a detokenizer each
    assert len(set(map(tuple, expected))) > 1  # the seeds differ: so do the choices
    # Three forks took a reference to each prompt block instead of prefilling it again.
    assert after.blocks_shared - before.blocks_shared == 3 * -(-length // BLOCK)
    copies = after.blocks_copied - before.blocks_copied
    assert copies == (0 if length % BLOCK == 0 else 3)  # the last writer keeps the original
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    assert _all_free(llm.engine)


def test_n_with_a_prefix_cache_hit_and_among_other_requests(llm: LLM) -> None:
    """The prompt's blocks come from the prefix cache for both runs; the forked request runs
    beside an unrelated one."""
    (prompt, other) = random_prompts([45, 30], seed=7)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))  # warm the cache
    queried = llm.engine.stats().prefix_hit_tokens
    expected = _separate(llm, prompt, 3)
    outs = llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": other}],
        [_params(n=3), _params(seed=5)],
    )
    assert llm.engine.stats().prefix_hit_tokens - queried >= 4 * 32  # 2 blocks, 4 requests
    assert _choices(outs[0]) == expected
    assert len(outs[1].outputs) == 1
    assert _all_free(llm.engine)


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm: LLM) -> None:
    (prompt,) = random_prompts([27], seed=11)
    every = llm.generate({"prompt_token_ids": prompt}, _params(n=5, logprobs=0, max_tokens=8))
    sums = []
    for c in every[0].outputs:
        assert c.logprobs is not None
        total = sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)
        sums.append((total, c.token_ids))
    best = sorted(sums, key=lambda s: -s[0])[:2]
    # best_of=5 draws the same five (seeds seed .. seed + 4) and keeps the two best, unasked
    # for log-probabilities computed all the same.
    (out,) = llm.generate({"prompt_token_ids": prompt}, _params(n=2, best_of=5, max_tokens=8))
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [tokens for _, tokens in best]
    got = [c.cumulative_logprob for c in out.outputs]
    assert got == pytest.approx([total for total, _ in best], abs=1e-5)
    assert all(c.logprobs is None for c in out.outputs)  # not asked for: not returned
    assert _all_free(llm.engine)


def test_deltas_carry_each_choice_and_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    (prompt,) = random_prompts([37], seed=3)
    engine.add_request("a", prompt, _params(n=3, max_tokens=40))
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(6):  # the prompt's two chunks, then decodes
        for d in engine.step():
            seen[d.index] += d.token_ids
    assert all(len(tokens) >= 3 for tokens in seen.values())
    assert engine.stats().num_running == 3 and not engine.is_finished("a")
    delta = engine.abort_request("a")
    assert delta is not None and delta.finish_reason == "abort"
    assert engine.is_finished("a")
    out = engine.get_output("a")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert [c.token_ids for c in out.outputs] == [seen[i] for i in range(3)]
    engine.release("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert _all_free(engine)
    # Aborted before its prompt was computed: the choices never forked end with it.
    engine.add_request("b", prompt, _params(n=3))
    engine.step()
    engine.abort_request("b")
    assert engine.is_finished("b") and _all_free(engine)
    engine.release("b")


def test_only_the_last_delta_of_a_request_ends_it(llm: LLM) -> None:
    """Choices ending at different steps (a stop token that choice 0 samples early): each
    finish reason ends its choice; `request_finished` is on the request's last delta only."""
    (prompt,) = random_prompts([21], seed=5)
    free = _choices(llm.generate({"prompt_token_ids": prompt}, _params(n=3, max_tokens=8))[0])
    stop = next(t for t in free[0][1:] if t not in free[1] and t not in free[2])
    ends_at = free[0].index(stop) + 1
    engine = llm.engine
    engine.add_request("s", prompt, _params(n=3, max_tokens=8, stop_token_ids=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    finishes = [(d.index, d.finish_reason) for d in deltas if d.finish_reason]
    assert finishes == [(0, "stop"), (1, "length"), (2, "length")]
    assert [d.request_finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    out = engine.get_output("s")
    assert [len(c.token_ids) for c in out.outputs] == [ends_at, 8, 8]
    assert _choices(out) == [free[0][:ends_at], free[1], free[2]]
    engine.release("s")
    assert _all_free(engine)


def test_prefill_and_decode_workers_hand_over_every_choice(llm: LLM, tiny_model) -> None:
    """The mesh's path. A prefill worker runs the request with max_tokens=1: one delta per
    choice, each its first token. A decode worker reserves blocks for the prompt, receives its
    KV (copied here from the prefill engine's cache) and commits the first tokens: the
    reservation forks into the choices, which decode what one engine alone gives."""
    prefill = llm.engine
    (prompt,) = random_prompts([29], seed=13)
    params = _params(n=3, max_tokens=6)
    expected = _choices(llm.generate({"prompt_token_ids": prompt}, params)[0])

    prefill.add_request("p", prompt, _params(n=3, max_tokens=1))
    deltas = prefill.step()
    while not prefill.is_finished("p"):
        deltas = prefill.step()
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    assert all(d.finish_reason == "length" and len(d.token_ids) == 1 for d in deltas)
    # All three end in one step; only the last delta says the request has ended.
    assert [d.request_finished for d in deltas] == [False, False, True]
    first = {d.index: d.token_ids[0] for d in deltas}
    prefill.release("p")
    assert [first[i] for i in range(3)] == [c[0] for c in expected]
    # The same prompt once more, stopped after its first step, for its KV blocks.
    seq = prefill.add_request("kv", prompt, _params(n=3, max_tokens=2))
    while not seq.output_token_ids:
        prefill.step()
    source = seq.block_table[: -(-len(prompt) // BLOCK)]

    decode = LLMEngine(EngineConfig(model=str(tiny_model("llama")), kv_cache_tokens=1024))
    reserved = decode.reserve_prefill("d", prompt, params)
    assert reserved is not None and reserved.first_block == 0
    cache = decode.runner.kv_cache.data  # [layers, 2, blocks, block_size, heads, head_dim]
    cache[:, :, reserved.block_ids] = prefill.runner.kv_cache.data[:, :, source]
    prefill.abort_request("kv")
    prefill.release("kv")
    with pytest.raises(ValueError, match="1 first tokens and 0 log-probabilities for 3"):
        decode.commit_prefill("d", FirstTokens([first[0]]))
    assert decode.is_reserved("d")  # refused: nothing changed
    committed = decode.commit_prefill("d", FirstTokens([first[i] for i in range(3)]))
    assert [d.index for d in committed] == [0, 1, 2]
    assert decode.fork_stats().blocks_shared == 2 * 2  # two choices forked from two blocks
    while not decode.is_finished("d"):
        decode.step()
    assert _choices(decode.get_output("d")) == expected
    decode.release("d")
    assert _all_free(decode) and _all_free(prefill)


def test_bad_input_names_the_field_and_leaves_the_engine_healthy(llm: LLM) -> None:
    for kw, name in [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
    ]:
        with pytest.raises(InvalidRequest, match=name) as caught:
            SamplingParams(**kw)
        assert caught.value.field == name
    engine = llm.engine
    (prompt,) = random_prompts([40], seed=2)
    # 2048 tokens of cache: 16 sequences of up to 400 tokens can never be held together.
    for params, name in [
        (SamplingParams(n=16, max_tokens=400), "n"),
        (SamplingParams(n=2, best_of=16, max_tokens=400), "best_of"),
    ]:
        with pytest.raises(InvalidRequest, match=f"{name}=16 .* KV cache holds 128") as caught:
            engine.add_request("big", prompt, params)
        assert caught.value.field == name
    assert _all_free(engine) and not engine.has_unfinished_requests()
    (out,) = llm.generate({"prompt_token_ids": prompt}, _params(n=2, max_tokens=3))
    assert len(out.outputs) == 2


@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"async_scheduling": True}],
    ids=["tp2", "pp2", "async"],
)
def test_every_rank_copies_the_shared_blocks(tiny_model, layout: dict[str, object]) -> None:
    """TP=2 and PP=2 (gloo, a follower process) equal one rank: the follower copies the shared
    last block too, or its heads (layers) would attend over stale KV. Async scheduling: the
    choices' first decode is launched before their first tokens are read, its copies queued
    behind the step writing the block."""
    folder = str(tiny_model("llama"))
    (prompt,) = random_prompts([21], seed=21)
    params = _params(n=2, max_tokens=10, logprobs=0)
    config = dict(kv_cache_tokens=512, max_num_batched_tokens=64)
    (ref,) = LLM(folder, **config).generate({"prompt_token_ids": prompt}, params)
    with LLM(folder, **config, **layout) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt}, params)
        copied = llm.engine.fork_stats().blocks_copied
        free = _all_free(llm.engine)
        ahead = llm.engine.steps_launched_ahead
    assert _choices(out) == _choices(ref)
    # Tokens may survive a little wrong KV; their log-probabilities do not.
    got = [c.cumulative_logprob for c in out.outputs]
    assert got == pytest.approx([c.cumulative_logprob for c in ref.outputs], abs=1e-4)
    assert copied == 1 and free
    assert (ahead > 0) == ("async_scheduling" in layout)


def test_forked_choices_preempted_and_recomputed(llm: LLM, tiny_model) -> None:
    """Two requests of n=2 in a cache that holds one of them at its longest: choices give way
    and are recomputed from prompt and output, their tokens unchanged."""
    prompts = random_prompts([21, 26], seed=17)
    params = _params(n=2, max_tokens=40)
    expected = [
        _choices(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    # 12 blocks: at their longest the requests need 1 + 2 x 3 (21 tokens) and 1 + 2 x 4 (26).
    with LLM(str(tiny_model("llama")), kv_cache_tokens=12 * BLOCK) as small:
        outs = small.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert small.engine.stats().num_preemptions > 0
        assert _all_free(small.engine)
    assert [_choices(o) for o in outs] == expected


def test_engine_config_max_num_seqs_bounds_n(tiny_model) -> None:
    folder = str(tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_tokens=256, max_num_seqs=2))
    with pytest.raises(InvalidRequest, match="max_num_seqs") as caught:
        engine.add_request("x", [1, 2, 3], SamplingParams(n=3))
    assert caught.value.field == "n"
