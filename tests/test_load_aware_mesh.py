"""Load-aware conditional disaggregation in a real mesh (`pdmesh up --load-aware-disagg`): behind a
burst of long prompts the router has the decode worker prefill some itself, from the rates it
measured and both workers' queues as it booked them; every stream equals the offline engine's,
and every booking comes back once the streams end (router/policies/base.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from mesh_support import Mesh, greedy_tokens, start_mesh

from pdmesh import LLM, SamplingParams

# --slo-ttft-ms 1: every queue misses it, so the queues alone decide.
MESH = (
    "--prefill", "1", "--decode", "1", "--load-aware-disagg", "--slo-ttft-ms", "1",
    "--kv-cache-tokens", "16384", "--max-num-batched-tokens", "256", "--disagg-min-tokens", "64",
)  # fmt: skip


def _metric(mesh: Mesh, name: str, **labels: str) -> float:
    return mesh.router_metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_burst_of_long_prompts_is_split_between_the_prefill_and_the_decode_worker(
    small_llm: LLM, small_model_folder: Path
) -> None:
    mesh = start_mesh(
        *MESH,
        model=small_model_folder,
        http=True,
    )
    try:
        rng = random.Random(33)
        vocab = small_llm.engine.info.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(200)] for _ in range(11)]
        # The first is sent alone: the router measures the prefill rate from it.
        got = asyncio.run(greedy_tokens(mesh.target, prompts[:1], 12))
        got += asyncio.run(greedy_tokens(mesh.target, prompts[1:], 12))
        want = small_llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        )
        assert got == [w.outputs[0].token_ids for w in want]

        policy = {"policy": "kv"}
        local = _metric(
            mesh, "pdmesh_router_dispatch_decisions_total", **policy, outcome="local_prefill"
        )
        remote = _metric(
            mesh, "pdmesh_router_dispatch_decisions_total", **policy, outcome="remote_prefill"
        )
        # Both workers took a share: the prompts the decode worker already prefilled counted
        # against it (without them it took 9 of the 10 of the burst).
        assert (local + remote, remote >= 4, local >= 2) == (11, True, True), (local, remote)
        decode = mesh.stats(mesh.decode[0])
        assert (decode.remote_prefills, decode.prefill_fallbacks) == (remote, 0)
        assert _metric(mesh, "pdmesh_router_worker_streams", worker=mesh.decode[0]) == 0
        mesh.wait_blocks_free(10.0)

    finally:
        mesh.stop()
