"""EPLB: the placement algorithm, and real expert-parallel workers (follower processes, gloo)
that re-place their experts between steps without changing a token."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from mesh_support import greedy_tokens, start_mesh
from prometheus_client import generate_latest
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.bench.eplb_cpu import make_moe
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.eplb.placement import (
    check_eplb,
    imbalance,
    initial_placement,
    moved_slots,
    rebalance,
    tokens_per_rank,
)
from pdmesh.engine.outputs import EngineStats
from pdmesh.kernels.moe import moe_experts_ref
from pdmesh.observability.worker_collector import EplbFigures, WorkerSnapshot, worker_registry

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Forced rebalances: a placement from the last 3 steps' load every 3 steps.
EPLB = dict(enable_eplb=True, eplb_window_size=3, eplb_step_interval=3)


def _tokens(
    folder: Path, prompts: list[list[int]], logits: list | None = None, **options: object
) -> tuple[list, object]:
    """Greedy tokens of each prompt, and the engine's EPLB figures. logits: gets each step's
    logits as rank 0 computes them (the model's own compute_logits, recorded)."""
    with LLM(
        str(folder),
        kv_cache_tokens=1024,
        max_num_batched_tokens=64,
        enable_expert_parallel=True,
        **options,
    ) as llm:
        if logits is not None:
            model = llm.engine.runner.model
            compute = model.compute_logits
            model.compute_logits = lambda h: logits.append(compute(h)) or logits[-1]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        return [o.outputs[0].token_ids for o in outputs], llm.engine.eplb_stats()


def _predicted(load: list[int], placement: tuple[int, ...], ranks: int) -> float:
    """Imbalance of `placement` if each expert's load splits evenly over its replicas."""
    per_slot = [load[e] / placement.count(e) for e in placement]
    return imbalance([per_slot], ranks)


# -- the algorithm -------------------------------------------------------------------------------
def test_hot_experts_are_replicated_onto_other_ranks() -> None:
    load = [900, 10, 10, 800, 10, 10, 10, 10]  # experts 0 and 3 hot, both on rank 0 at start
    old = initial_placement(1, 8, 10)
    assert old == ((0, 1, 2, 3, 4, 5, 6, 7, 0, 1),)
    (new,) = rebalance([load], old, num_ranks=2)
    # Each hot expert has a replica on both ranks; every expert is still held.
    assert sorted(new[:5]).count(0) == 1 and sorted(new[5:]).count(0) == 1
    assert new[:5].count(3) == 1 and new[5:].count(3) == 1
    assert set(new) == set(range(8))
    assert _predicted(load, old[0], 2) > 1.4
    assert _predicted(load, new, 2) < 1.05


def test_packing_balances_ranks_without_redundancy() -> None:
    load = [50, 40, 30, 20, 10, 5, 3, 1, 1]  # 9 experts over 3 ranks, hottest first at start
    old = initial_placement(1, 9, 9)
    (new,) = rebalance([load], old, num_ranks=3)
    assert sorted(new) == list(range(9))  # a permutation: no replicas without spare slots
    before = tokens_per_rank([load[e] for e in old[0]], 3)
    after = tokens_per_rank([load[e] for e in new], 3)
    assert max(before) == 120 and max(after) < 60


def test_a_balanced_placement_is_kept_slot_for_slot() -> None:
    """Experts already where they should be keep their slots: nothing moves."""
    load = [[10, 10, 10, 10], [7, 1, 1, 7]]
    first = rebalance(load, initial_placement(2, 4, 4), num_ranks=2)
    again = rebalance(load, first, num_ranks=2)
    assert again == first and moved_slots(first, again) == 0
    assert rebalance(load, first, num_ranks=2) == again  # deterministic


def test_a_steady_load_moves_nothing_after_its_first_rebalance() -> None:
    """Counts that barely differ from the last window's keep the placement; a shifted load, one
    that pays to follow, moves it again."""
    load = [900, 10, 10, 800, 10, 10, 10, 10]
    first = rebalance([load], initial_placement(1, 8, 10), num_ranks=2)
    assert moved_slots(initial_placement(1, 8, 10), first) > 0
    nearly = [905, 12, 9, 790, 11, 10, 8, 14]
    assert rebalance([nearly], first, num_ranks=2) == first
    a, b = [e for e in first[0][:5] if e not in first[0][5:]][:2]  # two experts only rank 0 has
    shifted = [900 if e == a else 800 if e == b else 10 for e in range(8)]  # now those are hot
    moved = rebalance([shifted], first, num_ranks=2)
    assert moved_slots(first, moved) > 0
    assert _predicted(shifted, moved[0], 2) < _predicted(shifted, first[0], 2) - 0.1


def test_imbalance_is_max_over_mean_summed_over_layers() -> None:
    assert imbalance([[4, 4, 0, 0], [1, 1, 1, 1]], 2) == pytest.approx((8 + 2) / (4 + 2))
    assert imbalance([[0, 0]], 2) == 1.0


def test_expert_rows_do_not_depend_on_their_batch() -> None:
    """What keeps outputs unchanged when a replica takes part of an expert's tokens: each row's
    result is the same whether 1, 3 or 40 rows share its expert (a CPU GEMM of 1..7 rows
    otherwise rounds differently)."""
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(40, 64), torch.randn(1, 64, 64), torch.randn(1, 64, 32)
    ids, weights = torch.zeros(40, 1, dtype=torch.int64), torch.rand(40, 1)
    whole = moe_experts_ref(x, w13, w2, weights, ids)
    for lo, hi in [(0, 1), (1, 4), (4, 11), (11, 40)]:
        part = moe_experts_ref(x[lo:hi], w13, w2, weights[lo:hi], ids[lo:hi])
        assert torch.equal(part, whole[lo:hi])


# -- bad configurations --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(enable_eplb=True),
            "needs enable_expert_parallel and tensor_parallel_size x data_parallel_size >= 2",
        ),
        (
            dict(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=1),
            "tensor_parallel_size=1",
        ),
        (dict(num_redundant_experts=2), "num_redundant_experts=2 needs enable_eplb"),
        (dict(enable_eplb=True, num_redundant_experts=-1), "num_redundant_experts must be"),
        (dict(eplb_window_size=0), "eplb_window_size must be an integer >= 1, got 0"),
        (dict(eplb_step_interval=0), "eplb_step_interval must be an integer >= 1, got 0"),
        (
            dict(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2,
                 pipeline_parallel_size=2),
            "pipeline_parallel_size=2",
        ),
    ],
)  # fmt: skip
def test_bad_eplb_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_slots_that_do_not_divide_name_the_counts_and_valid_values() -> None:
    with pytest.raises(ValueError) as err:
        check_eplb(8, 2, 3)
    assert "8 experts + num_redundant_experts=2 = 10 physical experts" in str(err.value)
    assert "3 expert-parallel ranks; valid num_redundant_experts: 1, 4, 7, 10" in str(err.value)
    check_eplb(8, 1, 3)  # 9 slots over 3 ranks
    with pytest.raises(ValueError, match="this model is dense"):
        check_eplb(0, 0, 2)


def test_bad_models_fail_before_any_rank_starts(tiny_model) -> None:
    with pytest.raises(ValueError, match="this model is dense"):
        LLM(str(tiny_model("llama")), tensor_parallel_size=2, enable_expert_parallel=True,
            enable_eplb=True)  # fmt: skip
    with pytest.raises(ValueError, match="valid num_redundant_experts: 0, 2, 4, 6"):
        LLM(str(tiny_model("qwen3_moe")), tensor_parallel_size=2, enable_expert_parallel=True,
            enable_eplb=True, num_redundant_experts=1)  # fmt: skip


# -- real workers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE whose 6 heads and 12 experts (top 2) split over 2 and 3 ranks."""
    return make_moe(tmp_path_factory.mktemp("moe"), experts=MOE_EXPERTS)


MOE_EXPERTS = 12


@pytest.mark.parametrize(("ep", "redundant"), [(2, 2), (3, 3)])
def test_outputs_identical_with_eplb_on_and_off(moe_folder: Path, ep: int, redundant: int) -> None:
    """Not only the tokens: every step's logits are bit-identical (without the padding of
    `_linear_batch_invariant` they differ by ~1e-6 here once a replica takes part of an
    expert's rows)."""
    prompts = random_prompts([5, 17, 40, 70, 9, 33])
    logits_off: list[torch.Tensor] = []
    logits_on: list[torch.Tensor] = []
    off, _ = _tokens(moe_folder, prompts, logits_off, tensor_parallel_size=ep)
    on, stats = _tokens(
        moe_folder,
        prompts,
        logits_on,
        tensor_parallel_size=ep,
        num_redundant_experts=redundant,
        **EPLB,
    )
    assert on == off
    assert len(logits_on) == len(logits_off) > 0
    for a, b in zip(logits_off, logits_on, strict=True):
        assert torch.equal(a, b)
    hf = load_hf(moe_folder)
    assert on == [hf_greedy(hf, p, PARAMS.max_tokens, ignore_eos=True) for p in prompts]
    assert stats.rebalances >= 3 and stats.experts_moved > 0
    slots = MOE_EXPERTS + redundant
    assert stats.placement != initial_placement(2, MOE_EXPERTS, slots)  # the weights really moved
    assert len(stats.physical_expert_tokens) == slots
    # Every (token, expert) pair of every MoE layer went to exactly one physical slot.
    prompt_tokens = sum(map(len, prompts)) + len(prompts) * (PARAMS.max_tokens - 1)
    assert sum(stats.physical_expert_tokens) == prompt_tokens * 2 * 2  # top 2, 2 MoE layers


def test_mixtral_with_eplb_equals_transformers(tiny_model) -> None:
    folder = tiny_model("mixtral")  # 4 experts, 2 layers; 6 slots over 2 ranks
    prompts = random_prompts([5, 40, 23])
    on, stats = _tokens(folder, prompts, tensor_parallel_size=2, num_redundant_experts=2, **EPLB)
    hf = load_hf(folder)
    assert on == [hf_greedy(hf, p, PARAMS.max_tokens, ignore_eos=True) for p in prompts]
    assert stats.rebalances > 0 and stats.placement != initial_placement(2, 4, 6)


def test_skewed_routing_imbalance_drops_after_rebalancing(tmp_path: Path) -> None:
    """Most tokens route to experts 2 and 3, both on rank 0 at start: rank 0 does nearly all
    the expert work. The first rebalance gives each a replica on rank 1."""
    folder = make_moe(tmp_path, skew=2.0, hot=(2, 3))
    prompts = random_prompts([60, 50, 40, 30])
    _, stats = _tokens(folder, prompts, tensor_parallel_size=2, num_redundant_experts=2,
                       enable_eplb=True, eplb_window_size=4, eplb_step_interval=4)  # fmt: skip
    before, after = stats.imbalance_history[0], stats.imbalance_history[1]
    assert before > 1.8  # of at most 2.0: one rank of two did (nearly) everything
    assert after < 1.1
    for layer in stats.placement:
        for hot in (2, 3):
            assert layer[:5].count(hot) == 1 and layer[5:].count(hot) == 1


def test_pdmesh_up_passes_eplb_to_its_workers_and_get_stats_reports_it(
    moe_folder: Path,
) -> None:
    """Through a router to a decode worker of two expert-parallel ranks with EPLB: the same
    tokens as transformers, and the worker's GetStats carries EPLB's figures."""
    mesh = start_mesh(
        "--model", str(moe_folder), "--prefill", "0", "--decode", "1", "--decode-tp", "2",
        "--kv-cache-tokens", "1024", "--max-num-batched-tokens", "64",
        "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts", "2",
        "--eplb-window-size", "3", "--eplb-step-interval", "3",
    )  # fmt: skip
    try:
        prompts = random_prompts([20, 45, 9])
        got = asyncio.run(greedy_tokens(mesh.target, prompts, PARAMS.max_tokens))
        stats = mesh.stats(mesh.decode[0])
    finally:
        mesh.stop()
    hf = load_hf(moe_folder)
    assert got == [hf_greedy(hf, p, PARAMS.max_tokens, ignore_eos=True) for p in prompts]
    assert stats.eplb_rebalances > 0 and stats.eplb_imbalance >= 1.0
    assert len(stats.physical_expert_token_counts) == MOE_EXPERTS + 2
    assert sum(stats.physical_expert_token_counts) == sum(stats.expert_token_counts) > 0


def test_metrics_show_eplb_figures() -> None:
    figures = EplbFigures(physical_expert_tokens=(5, 0, 7), rebalances=4, imbalance=1.25)
    snapshot = WorkerSnapshot(_ENGINE_ZEROS, (), eplb=figures)
    text = generate_latest(worker_registry("decode", lambda: snapshot)).decode()
    assert 'pdmesh_eplb_physical_expert_tokens_total{physical_expert="2",role="decode"} 7.0' in text
    assert 'pdmesh_eplb_rebalances_total{role="decode"} 4.0' in text
    assert 'pdmesh_eplb_imbalance{role="decode"} 1.25' in text
    off = generate_latest(worker_registry("decode", lambda: WorkerSnapshot(_ENGINE_ZEROS, ())))
    assert b"# TYPE pdmesh_eplb_imbalance gauge" in off  # described, without samples
    assert b"pdmesh_eplb_imbalance{" not in off


_ENGINE_ZEROS = dict.fromkeys((f.name for f in dataclasses.fields(EngineStats)), 0)
