"""The engine side of a failover: a request resumed with the output already streamed appended to
its prompt (`num_output_tokens`) continues exactly where the lost worker was, counting that
output for max_tokens, stop strings, seeds and usage; and the scheduler's count of requests
queued beyond the KV cache (the decode worker's bounded queue)."""

from __future__ import annotations

import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence

PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model("llama")), kv_cache_tokens=2048)


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, sent: int = 0):
    """(text of each step's delta, the final output) of one request run alone."""
    engine.add_request(rid, prompt, params, num_output_tokens=sent)
    texts: list[str] = []
    while engine.has_unfinished_requests():
        texts += [d.text for d in engine.step() if d.request_id == rid]
    out = engine.get_output(rid)
    engine.release(rid)
    return texts, out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_request_continues_where_it_stopped(llm: LLM, params: SamplingParams) -> None:
    engine = llm.engine
    texts, whole = _run(engine, "whole", PROMPT, params)
    tokens = whole.outputs[0].token_ids
    for sent in (1, 9, 23):
        resumed_texts, resumed = _run(
            engine, f"resumed-{sent}", PROMPT + tokens[:sent], params, sent
        )
        assert resumed.outputs[0].token_ids == tokens  # the sent ones count as output
        assert resumed.prompt_token_ids == PROMPT
        assert resumed.outputs[0].finish_reason == "length"  # max_tokens over both parts
        # What a client saw before the failover plus what the new worker sends = the whole.
        assert "".join(texts[:sent]) + "".join(resumed_texts) == whole.outputs[0].text


def test_a_stop_string_across_the_failover_is_found_and_held_back(llm: LLM) -> None:
    engine = llm.engine
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = _run(engine, "probe", PROMPT, greedy)[1].outputs[0].token_ids
    tok = llm.get_tokenizer()
    for i in range(3, 20):  # a stop string over tokens i+1 and i+2, found first there
        stop = tok.decode(tokens[i : i + 2])
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
        texts, whole = _run(engine, f"whole-{i}", PROMPT, params)
        if len(whole.outputs[0].token_ids) == i + 2:
            break
    assert whole.outputs[0].finish_reason == "stop"
    # Lost after i+1 tokens: part of the stop string was streamed as tokens, held back as text.
    resumed_texts, resumed = _run(engine, "resumed", PROMPT + tokens[: i + 1], params, i + 1)
    assert resumed.outputs[0].finish_reason == "stop"
    assert resumed.outputs[0].token_ids == whole.outputs[0].token_ids
    assert "".join(texts[: i + 1]) + "".join(resumed_texts) == whole.outputs[0].text


def test_num_output_tokens_is_checked(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    for bad in (-1, 4, len(PROMPT)):
        with pytest.raises(ValueError, match="num_output_tokens_sent"):
            llm.engine.add_request(f"bad-{bad}", PROMPT, params, num_output_tokens=bad)


def test_requests_beyond_the_free_blocks_are_counted_in_arrival_order() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams()
    for i, n in enumerate([16, 16, 4, 4]):  # 4 + 4 blocks fit in 10; then 1 fits, then 1
        sched.add(Sequence(f"s{i}", list(range(n)), params))
    assert sched.num_waiting_for_blocks() == 0
    sched.add(Sequence("big", list(range(12)), params))  # 3 blocks: no longer fits
    sched.add(Sequence("small", [1], params))  # fits, but may not overtake "big"
    assert sched.num_waiting_for_blocks() == 2
