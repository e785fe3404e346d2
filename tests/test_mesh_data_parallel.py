"""Data-parallel mesh workers (`--data-parallel-size`, serving/lockstep.py): a decode worker of
two data-parallel ranks under data-parallel attention, through `pdmesh up` and a router, as a
user runs it; each rank a worker of its own with its KV plane, stepping in lockstep."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from mesh_support import greedy_tokens, start_mesh
from support import hf_greedy, load_hf, random_prompts

from pdmesh.cli import build_parser
from pdmesh.decode_service.config import DecodeConfig
from pdmesh.engine.config import EngineConfig
from pdmesh.mesh import plan_mesh
from pdmesh.serving.data_parallel import DataParallelRank

MAX_TOKENS = 10


def test_a_decode_worker_of_two_dp_ranks_serves_through_the_router(tiny_model) -> None:
    """Prompts of 64 tokens or more are prefilled by the prefill worker and their KV pushed to
    the decode rank that holds them; shorter ones on that rank. Tokens equal transformers', both
    ranks serve, every block is freed; then one request alone (its peer rank idle) after the
    group went idle, and again."""
    folder = tiny_model("qwen3_moe")
    mesh = start_mesh(
        "--model", str(folder), "--prefill", "1", "--decode", "1", "--decode-dp", "2",
        "--enable-expert-parallel", "--kv-cache-tokens", "1024",
        "--max-num-batched-tokens", "64",
    )  # fmt: skip
    try:
        assert len(mesh.decode) == 2 and len(mesh.prefill) == 1
        prompts = random_prompts([20, 100, 70, 9, 130, 40, 66, 12])
        got = asyncio.run(greedy_tokens(mesh.target, prompts, MAX_TOKENS))
        alone = [asyncio.run(greedy_tokens(mesh.target, [p], MAX_TOKENS))[0] for p in prompts[:2]]
        stats = [mesh.stats(a) for a in mesh.decode]
    finally:
        mesh.stop()
    hf = load_hf(folder)
    want = [hf_greedy(hf, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    assert got == want
    assert alone == want[:2]
    assert [(s.data_parallel_size, s.data_parallel_rank) for s in stats] == [(2, 0), (2, 1)]
    assert all(s.data_parallel_attention for s in stats)  # one MoE group, experts split
    assert all(s.prefix_queried_tokens > 0 for s in stats), "a rank served nothing"
    assert sum(s.remote_prefills for s in stats) > 0
    assert sum(s.local_prefills for s in stats) > 0
    assert [s.kv_blocks_used for s in stats] == [0, 0]


def _up(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_pdmesh_up_plans_a_process_per_data_parallel_rank() -> None:
    specs = plan_mesh(_up("--prefill", "1", "--decode", "2", "--decode-dp", "2"))
    names = [s.name for s in specs]
    pool = ["decode-0-dp0", "decode-0-dp1", "decode-1-dp0", "decode-1-dp1"]
    assert names == ["prefill-0", *pool, "router"]

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    decode = [s.command for s in specs if s.name.startswith("decode")]
    assert [flag(a, "--data-parallel-rank") for a in decode] == ["0", "1", "0", "1"]
    addresses = [flag(a, "--data-parallel-address") for a in decode]
    assert addresses[0] == addresses[1] != addresses[2] == addresses[3]
    assert all(flag(a, "--data-parallel-size") == "2" for a in decode)
    assert "--data-parallel-rank" not in specs[0].command  # the prefill pool: one rank
    router = specs[-1].command
    assert len(flag(router, "--decode").split(",")) == 4


def test_a_data_parallel_worker_must_say_which_rank_it_is() -> None:
    engine = EngineConfig(data_parallel_size=2)
    with pytest.raises(ValueError, match="--data-parallel-rank R and --data-parallel-address"):
        DecodeConfig(engine=engine)
    with pytest.raises(ValueError, match=r"--data-parallel-rank must be in 0 \.\. 1"):
        DecodeConfig(engine=engine, data_parallel=DataParallelRank(2, "127.0.0.1:5000"))
    with pytest.raises(ValueError, match="--data-parallel-address wants HOST:PORT"):
        DecodeConfig(engine=engine, data_parallel=DataParallelRank(1, "nowhere"))
    DecodeConfig(engine=engine, data_parallel=DataParallelRank(1, "127.0.0.1:5000"))
