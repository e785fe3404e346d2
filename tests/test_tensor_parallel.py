"""Tensor and expert parallelism on CPU (gloo): real follower processes, real collectives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.parallel.group import SINGLE
from pdmesh.engine.parallel.symm_all_reduce import symmetric_all_reduce

GREEDY = SamplingParams(max_tokens=24, temperature=0)
CLOSE_S = 5.0  # seconds a two-rank engine may take to close
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time there was a dragon who lived in a cave and",
]


def test_tp3_equals_tp1(small_llm: LLM, small_model_folder: Path) -> None:
    """The default model's tokenizer and 3 KV heads, small (conftest): one KV head a rank."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in small_llm.generate(PROMPTS, params)]
    with LLM(str(small_model_folder), kv_cache_tokens=4096, tensor_parallel_size=3) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        heads = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert (heads.num_heads, heads.num_kv_heads) == (2, 1)  # 6 and 3 heads over 3 ranks
    assert got == expected


@pytest.mark.parametrize(
    ("overlap", "channel"),
    [(None, "auto"), (True, "auto"), (True, "shm")],
    ids=["default", "async", "async-shm"],
)
def test_tiny_llama_tp2_equals_tp1(tiny_model, monkeypatch, overlap: bool | None, channel) -> None:
    """async: the follower rank runs the decode steps rank 0 launches ahead, their input ids
    taken on the device from the step before. default: steps of up to 512 tokens, whose inputs
    outgrow the step's first message to the follower (step_codec.INLINE) and cross in two.
    shm: the steps go through shared memory, as on GPUs (engine/parallel/step_channel.py)."""
    monkeypatch.setenv("PDMESH_STEP_CHANNEL", channel)
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 40, 100, 150, 300])]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in LLM(folder, kv_cache_tokens=1024).generate(prompts, params)
    ]
    llm = LLM(
        folder,
        kv_cache_tokens=1024,
        tensor_parallel_size=2,
        max_num_batched_tokens=64 if overlap else 512,
        async_scheduling=overlap,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ahead = llm.engine.steps_launched_ahead
    assert llm.engine.tp_driver.channel.shared == (channel == "shm")
    start = time.perf_counter()
    llm.close()
    # Generous for a loaded 2-core machine; the ranks stop and tear down together (a rank
    # waiting out another's teardown took 10.7 s on two GPUs).
    assert time.perf_counter() - start < CLOSE_S
    assert got == expected
    assert (ahead > 0) == bool(overlap)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_moe_parallel_matches_transformers(tiny_model, arch: str, expert_parallel: bool) -> None:
    """Expert parallelism on a CPU exchanges over all_to_all (EPLB's way; the all_reduce
    exchange, the GPUs' default, is tested below and in tests/gpu)."""
    folder = tiny_model(arch)
    prompts = random_prompts([5, 17, 40, 100])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(
        str(folder),
        kv_cache_tokens=1024,
        tensor_parallel_size=2,
        max_num_batched_tokens=64,
        enable_expert_parallel=expert_parallel,
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        all_to_all = llm.engine.runner.tp.counters["all_to_all"]
        counts = llm.engine.expert_counts()
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16, ignore_eos=True)
    if expert_parallel:
        assert all_to_all > 0  # the dispatch / combine path ran
        # Every routed (token, expert) pair was counted once across the ranks.
        assert counts is not None and sum(counts) > 0
    else:
        assert all_to_all == 0


# EPLB's placement of 8 experts in 10 slots (2 redundant), 5 a rank: experts 4 and 0, the two
# the test's tokens route to most (5 and 4 of 22 pairs), in a slot on each rank.
EPLB_PLACEMENT = (0, 1, 2, 3, 4, 5, 6, 7, 4, 0)


def _all_reduce_moe_rank(rank: int, init_method: str, placement: tuple[int, ...] | None) -> None:
    """One of two gloo ranks: an expert-parallel MoE layer on the all_reduce exchange, holding
    experts 4 * rank .. 4 * rank + 3 of 8 (placement None), or the slots of an EPLB `placement`,
    against the whole layer on the same inputs."""
    from pdmesh.engine.layers.moe import FusedMoE
    from pdmesh.engine.parallel.group import ParallelGroup

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same weights and tokens on both ranks
        whole = FusedMoE(8, 2, 16, 32, renormalize=True)
        for p in (whole.gate.weight, whole.w13_weight, whole.w2_weight):
            p.data.normal_(0.0, 0.3)
        x = torch.randn(11, 16)  # 11 tokens: the ranks count 6 and 5 of them
        redundant = 0 if placement is None else len(placement) - 8
        group = ParallelGroup(rank, 2, dist.group.WORLD, expert_parallel=True, moe_all_reduce=True,
                              redundant_experts=redundant)  # fmt: skip
        mine = FusedMoE(8, 2, 16, 32, renormalize=True, tp=group)
        per_rank = mine.num_local_experts
        held = list(range(8))[4 * rank : 4 * rank + 4]
        if placement is not None:
            assert mine.experts is not None
            mine.experts.set(placement)
            held = list(placement[rank * per_rank : (rank + 1) * per_rank])
        mine.gate.weight.data.copy_(whole.gate.weight)
        mine.w13_weight.data.copy_(whole.w13_weight[held])
        mine.w2_weight.data.copy_(whole.w2_weight[held])
        got, want = mine(x), whole(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))
        counts = mine.expert_counts.clone()
        dist.all_reduce(counts)  # each (token, expert) pair counted once over the ranks
        assert torch.equal(counts, whole.expert_counts)
        if placement is not None:  # ... and once over the slots, each on one replica
            physical = mine.physical_counts.clone()
            dist.all_reduce(physical)
            by_expert = torch.zeros(8, dtype=torch.int64)
            by_expert.index_add_(0, torch.tensor(placement), physical)
            assert torch.equal(by_expert, whole.expert_counts)
            assert physical[4] > 0 and physical[8] > 0, "both replicas of expert 4 took pairs"
        assert group.counters["all_to_all"] == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("placement", [None, EPLB_PLACEMENT], ids=["in-order", "eplb"])
def test_expert_parallel_all_reduce_exchange_equals_the_whole_layer(
    tmp_path, placement: tuple[int, ...] | None
) -> None:
    """Each rank routes every token, computes the pairs of the experts it holds, and one
    all-reduce sums the ranks' parts: the whole layer's output, over real gloo ranks. With EPLB
    (the exchange GPUs use with it too) a replicated expert's pairs are split between its slots,
    each computed once."""
    torch.multiprocessing.spawn(
        _all_reduce_moe_rank,
        args=(f"file://{tmp_path / 'store'}", placement),
        nprocs=2,
        join=True,
    )


def test_tp_size_that_does_not_divide_heads_fails_clearly() -> None:
    with pytest.raises(ValueError) as err:
        LLM(kv_cache_tokens=1024, tensor_parallel_size=2)
    message = str(err.value)
    assert "9 attention heads" in message and "3 KV heads" in message
    assert "valid sizes: 1, 3, 9" in message


def test_all_reduce_way_is_checked(monkeypatch) -> None:
    """PDMESH_ALL_REDUCE names one of three ways; a wrong one is an error that names the
    variable, and on a CPU (gloo) no way brings symmetric memory in."""
    for way in ("auto", "staged", "nccl"):
        monkeypatch.setenv("PDMESH_ALL_REDUCE", way)
        assert symmetric_all_reduce(SINGLE, 64, torch.float32) is None
    monkeypatch.setenv("PDMESH_ALL_REDUCE", "ring")
    with pytest.raises(ValueError, match="PDMESH_ALL_REDUCE must be auto, staged or nccl"):
        symmetric_all_reduce(SINGLE, 64, torch.float32)
