"""Pipeline and expert parallelism on two GPUs (TP=2 x PP=2 on four): decode steps replay CUDA
graphs on every rank, greedy tokens equal one GPU's and transformers' (fp32), and the engine
closes quickly."""

from __future__ import annotations

import pytest
import torch
from support import close_seconds, generated_ids, hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Seconds a two-rank engine may take to close (it took 10.7 s while rank 0 tore its NCCL groups
# down only after the followers had exited, which they could not do before it).
CLOSE_S = 2.0


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return generated_ids(llm, prompts, GREEDY)


def test_pp2_replays_graphs_per_stage_and_equals_one_gpu(tiny_model) -> None:
    """Each stage captures its own layers; the hidden states cross between the graphs. One
    sequence at a time (one batch in flight) and five at once (a batch per stage)."""
    folder = str(tiny_model("llama"))
    prompts = random_prompts([7, 33, 64, 90, 5])
    one = LLM(folder, dtype="float32", kv_cache_tokens=4096)
    want = _tokens(one, prompts)
    del one
    pp = LLM(folder, dtype="float32", kv_cache_tokens=4096, pipeline_parallel_size=2)
    assert pp.engine.runner.graphs is not None
    assert [_tokens(pp, [p])[0] for p in prompts[:2]] == want[:2]
    assert _tokens(pp, prompts) == want
    assert pp.engine.most_in_flight == 2
    hf = load_hf(tiny_model("llama"))
    assert want[0] == hf_greedy(hf, prompts[0], GREEDY.max_tokens, ignore_eos=True)
    assert close_seconds(pp) < CLOSE_S


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp2_pp2_replays_graphs_per_stage_and_equals_one_gpu(tiny_model) -> None:
    """Stages of two TP ranks: each captures its layers with their all-reduces over symmetric
    memory among the stage's own ranks (they stepped eagerly until 2026-11-27: 5.7x one GPU)."""
    folder = str(tiny_model("llama"))
    prompts = random_prompts([7, 33, 64, 90, 5])
    one = LLM(folder, dtype="float32", kv_cache_tokens=4096)
    want = _tokens(one, prompts)
    del one
    llm = LLM(
        folder,
        dtype="float32",
        kv_cache_tokens=4096,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    runner = llm.engine.runner
    assert runner.graphs is not None and "all_reduce" in runner.tp.fast
    assert [_tokens(llm, [p])[0] for p in prompts[:2]] == want[:2]
    assert _tokens(llm, prompts) == want
    assert llm.engine.most_in_flight == 2
    assert close_seconds(llm) < CLOSE_S


def _ep2_matches_transformers(folder: object, **options: object) -> LLM:
    """TP=2 with expert parallelism (and `options`): decode graphs on the all-reduce exchange,
    greedy tokens equal to transformers' (fp32). Returns the engine, still open."""
    prompts = random_prompts([5, 17, 40, 100])
    llm = LLM(
        str(folder),
        dtype="float32",
        kv_cache_tokens=4096,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        **options,
    )
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.tp.moe_all_reduce
    got = _tokens(llm, prompts)
    hf = load_hf(folder)
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens, ignore_eos=True) for p in prompts]
    return llm


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_ep2_all_reduce_replays_graphs_and_matches_transformers(tiny_model, arch: str) -> None:
    """Expert parallelism's default exchange on GPUs: each rank holds half the experts, decode
    steps replay graphs, no all-to-all runs."""
    llm = _ep2_matches_transformers(tiny_model(arch))
    assert llm.engine.runner.tp.counters["all_to_all"] == 0
    counts = llm.engine.expert_counts()
    assert counts is not None and sum(counts) > 0
    assert close_seconds(llm) < CLOSE_S


def test_eplb_all_reduce_replays_graphs_and_matches_transformers(tiny_model) -> None:
    """EPLB on GPUs keeps the all-reduce exchange (it ran the eager all-to-all until 2026-11-27,
    0.23x EPLB off's tokens/s): decode steps replay graphs while experts move between them, in
    place, and the tokens stay transformers' (fp32)."""
    eplb = dict(enable_eplb=True, num_redundant_experts=2, eplb_window_size=4, eplb_step_interval=4)
    llm = _ep2_matches_transformers(tiny_model("qwen3_moe"), **eplb)
    stats = llm.engine.eplb_stats()
    assert stats is not None and stats.rebalances >= 4 and stats.experts_moved > 0
    # The weights' moves only (one a MoE layer a rebalance; the model has 2 MoE layers): the
    # all-to-all exchange would be four a MoE layer every step.
    assert llm.engine.runner.tp.counters["all_to_all"] <= 2 * stats.rebalances
    assert close_seconds(llm) < CLOSE_S
