"""Async scheduling: the next decode step launched before the current one's tokens are read
(engine/scheduling/overlap.py). Forced on here on the CPU, where it is off by default, and checked
against the same engine stepping one step at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support import random_prompts

from pdmesh import SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import FirstTokens

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _engine(folder: Path, overlap: bool, **kw: object) -> LLMEngine:
    options = dict(kv_cache_tokens=1024, max_num_batched_tokens=64, async_scheduling=overlap)
    return LLMEngine(EngineConfig(model=str(folder), **{**options, **kw}))  # type: ignore[arg-type]


def _drive(
    engine: LLMEngine,
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    on_step: Callable[[LLMEngine, int], None] = lambda e, i: None,
) -> dict[str, tuple[list[int], str | None]]:
    """Step until done, adding requests at the step numbers given; (tokens, finish reason) of
    each request."""
    step, ids = 0, []
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            ids.append(rid)
        on_step(engine, step)
        engine.step()
        step += 1
    outs = {rid: engine.get_output(rid).outputs[0] for rid in ids}
    return {rid: (o.token_ids, o.finish_reason) for rid, o in outs.items()}


def _workload(tiny: Path) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests arriving while others decode, ending every way a request ends: by max_tokens,
    by a stop token a step reveals, by max_model_len; greedy and seeded sampling."""
    prompts = random_prompts([9, 40, 23, 70, 5, 31], seed=3)
    reference = _engine(tiny, overlap=False)
    ids = _drive(reference, {0: [("probe", prompts[2], GREEDY)]})["probe"][0]
    stop = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ids[6]])
    seeded = SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    return {
        0: [("a", prompts[0], GREEDY), ("b", prompts[1], short)],
        2: [("stop", prompts[2], stop)],
        5: [("seeded", prompts[3], seeded), ("c", prompts[4], GREEDY)],
        11: [("long", prompts[5], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))],
    }


def test_tokens_equal_stepping_one_at_a_time(tiny_model) -> None:
    folder = tiny_model("llama")
    work = _workload(folder)
    want = _drive(_engine(folder, overlap=False, max_model_len=96), work)
    engine = _engine(folder, overlap=True, max_model_len=96)
    got = _drive(engine, work)
    assert got == want
    assert {r for r, (_, reason) in got.items() if reason == "stop"} == {"stop"}
    assert len(got["long"][0]) == 96 - 31  # ended by max_model_len
    assert engine.steps_launched_ahead > 10  # decode steps did overlap
    assert engine.stats().kv_blocks_used == 0  # every block back once the last step is read


def test_an_abort_frees_blocks_only_after_the_step_that_writes_them(tiny_model) -> None:
    folder = tiny_model("llama")
    prompts = random_prompts([20, 33], seed=8)
    arrivals = {0: [("kept", prompts[0], GREEDY), ("aborted", prompts[1], GREEDY)]}
    want = _drive(_engine(folder, overlap=False), arrivals)["kept"]
    seen: dict[str, int] = {}

    def abort_at_8(engine: LLMEngine, step: int) -> None:
        if step != 8:
            return
        assert engine.steps_launched_ahead > 0 and engine.has_unfinished_requests()
        used = engine.stats().kv_blocks_used
        engine.abort_request("aborted")
        seen["after_abort"] = engine.stats().kv_blocks_used
        seen["before"] = used

    engine = _engine(folder, overlap=True)
    got = _drive(engine, arrivals, abort_at_8)
    assert got["kept"] == want
    assert got["aborted"][1] == "abort" and len(got["aborted"][0]) == 8
    # The aborted request's blocks are held while the step launched ahead may write them...
    assert seen["after_abort"] == seen["before"]
    # ...and are back once it has been read.
    assert engine.stats().kv_blocks_used == 0


def test_preemption_under_block_pressure_gives_the_same_tokens(tiny_model) -> None:
    """Too few blocks for every sequence: the lookahead stands aside and the scheduler
    preempts as it does without it."""
    folder = tiny_model("llama")
    prompts = random_prompts([30, 30, 30], seed=4)
    arrivals = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]}
    want_engine = _engine(folder, overlap=False, kv_cache_tokens=128)
    want = _drive(want_engine, arrivals)
    assert want_engine.scheduler.num_preemptions > 0
    engine = _engine(folder, overlap=True, kv_cache_tokens=128)
    assert _drive(engine, arrivals) == want
    assert engine.scheduler.num_preemptions > 0 and engine.steps_launched_ahead > 0


@pytest.mark.parametrize("value", [None, False])
def test_off_by_default_without_cuda_graphs(tiny_model, value: bool | None) -> None:
    engine = _engine(tiny_model("llama"), overlap=value, device="cpu")  # type: ignore[arg-type]
    _drive(engine, {0: [("a", random_prompts([9])[0], GREEDY)]})
    assert not engine.async_scheduling and engine.steps_launched_ahead == 0


def test_no_step_is_launched_past_a_requests_last_token(tiny_model) -> None:
    engine = _engine(tiny_model("llama"), overlap=True)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    got = _drive(engine, {0: [("a", random_prompts([12])[0], params)]})
    assert len(got["a"][0]) == 7
    assert engine.steps_launched_ahead == 6  # tokens 2..7; the prompt's step samples the first


def test_a_prompt_prefilled_elsewhere_joins_the_next_step(tiny_model) -> None:
    """A request whose KV arrived from a prefill worker (commit_prefill) while decode steps run
    ahead is decoding two steps later, not once the others have finished."""
    engine = _engine(tiny_model("llama"), overlap=True)
    prompts = random_prompts([15, 18], seed=9)
    engine.add_request("running", prompts[0], GREEDY)
    assert engine.reserve_prefill("remote", prompts[1], GREEDY) is not None
    for _ in range(4):
        engine.step()
    assert engine.steps_launched_ahead > 0
    engine.commit_prefill("remote", FirstTokens([7]))
    for _ in range(2):
        engine.step()
    assert len(engine.get_output("remote").outputs[0].token_ids) >= 2
