"""An engine's warm-up (engine/warm_up.py): run on GPUs at start, callable anywhere. Afterwards the
engine is as new: nothing held or cached, counters at zero, the same tokens as an engine that
never warmed up."""

from __future__ import annotations

from pathlib import Path

from support import random_prompts

from pdmesh import SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.warm_up import warm_up

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def _engine(folder: Path) -> LLMEngine:
    config = EngineConfig(model=str(folder), kv_cache_tokens=512, max_num_batched_tokens=96)
    return LLMEngine(config)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY if i % 2 == 0 else SEEDED)
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.get_output(str(i)).outputs[0].token_ids for i in range(len(prompts))]


def test_a_warmed_up_engine_holds_nothing_and_answers_as_a_new_one(tiny_model) -> None:
    folder = tiny_model("llama")
    warmed = _engine(folder)
    assert warm_up(warmed) > 0
    stats = warmed.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (0, 0)
    assert warmed.prefill_rate.seconds_per_token is None and warmed.most_in_flight == 0
    assert not warmed.has_unfinished_requests()
    # Its prompts left no cached prefix: a prompt of the same tokens is computed anew.
    vocab = warmed.info.vocab_size
    echo = [(7 * i + 11) % vocab for i in range(40)]
    prompts = [echo, *random_prompts([17, 33, 5], seed=2)]
    tokens = _run(warmed, prompts)
    assert warmed.stats().prefix_hit_tokens == 0
    assert tokens == _run(_engine(folder), prompts)
