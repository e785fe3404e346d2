"""The planner on a real mesh (`pdmesh up --planner`: a router and three workers of either
role, one prefill and two decode, on the default model's tokenizer and layout made small, see
conftest): under a prefill-heavy load that misses the TTFT target it switches a decode worker to
prefill, every stream equal to the offline engine's greedy output (the switched worker's running
requests move with their KV); once the load ends it switches that worker back. What it did shows
on the router's /metrics."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from mesh_support import Mesh, start_mesh
from service_support import wait_until

from pdmesh import LLM, SamplingParams
from pdmesh.bench.serving import exact_request
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(400)

PROMPT_TOKENS = 384
# Six clients at once, each sending its next request when the last ends: four of short
# outputs, two of longer ones (streams mid-decode when a decode worker switches).
OUTPUT_TOKENS = (16, 16, 16, 16, 64, 64)
LOAD_S = 90  # the load stops once a worker switched, or after this
SWITCHES = "pdmesh_router_planner_switches_total"


@pytest.fixture(scope="module")
def mesh(small_model_folder: Path) -> Iterator[Mesh]:
    m = start_mesh(
        "--planner",
        "--prefill",
        "1",
        "--decode",
        "2",
        "--kv-cache-tokens",
        "16384",
        "--disagg-min-tokens",
        "16",
        # Looks every half second; a condition must hold two looks, switches 3 s apart.
        *("--planner-interval-s", "0.5", "--planner-sustain", "2", "--planner-dwell-s", "3"),
        # A TTFT target long prompts on one CPU prefill worker miss under load; an inter-token
        # target nothing misses: the decode side is relaxed, the prefill side starved.
        *("--slo-ttft-ms", "250", "--slo-itl-ms", "30000"),
        http=True,
        model=small_model_folder,
    )
    try:
        yield m
    finally:
        m.stop()


def _role(address: str) -> str:
    with grpc.insecure_channel(address) as ch:
        stats = worker_pb2_grpc.DecodeWorkerStub(ch).GetStats(worker_pb2.StatsRequest(), timeout=10)
    return stats.role


def _switches(mesh: Mesh) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["to_role"], dict(labels)["reason"]): value
        for (name, labels), value in mesh.router_metrics().items()
        if name == SWITCHES
    }


def test_the_planner_moves_a_decode_worker_to_prefill_under_load_and_back_after(
    mesh: Mesh, small_llm: LLM
) -> None:
    rng = random.Random(33)
    vocab = small_llm.engine.info.vocab_size
    done: list[tuple[list[int], int, list[int], str]] = []  # prompt, max tokens, tokens, text
    switched: list[str] = []
    deadline = time.monotonic() + LOAD_S

    def loaded() -> bool:
        return not switched and time.monotonic() < deadline

    async def load() -> None:
        async with grpc.aio.insecure_channel(mesh.target) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def client(max_tokens: int) -> None:
                while loaded():
                    prompt = [rng.randrange(1000, vocab) for _ in range(PROMPT_TOKENS)]
                    request = exact_request(prompt, max_tokens)
                    chunks = [r async for r in stub.Generate(request, timeout=120)]
                    tokens = [t for r in chunks for t in r.token_ids]
                    done.append((prompt, max_tokens, tokens, "".join(r.text for r in chunks)))

            async def watch() -> None:
                while loaded():
                    roles = await asyncio.gather(
                        *(asyncio.to_thread(_role, a) for a in mesh.decode)
                    )
                    pairs = zip(mesh.decode, roles, strict=True)
                    switched.extend(a for a, r in pairs if r == "prefill")
                    await asyncio.sleep(0.25)

            await asyncio.gather(watch(), *(client(n) for n in OUTPUT_TOKENS))

    start = time.monotonic()
    asyncio.run(load())
    assert switched, f"no decode worker switched to prefill in {time.monotonic() - start:.0f} s"
    (worker,) = switched
    assert _switches(mesh).get(("prefill", "prefill_starved")) == 1
    # The load has ended: the worker goes back to decode, the split the mesh started with.
    wait_until(lambda: _role(worker) == "decode", 60, f"{worker} back to decode")
    wait_until(lambda: _switches(mesh).get(("decode", "idle")) == 1, 10, "the switch back counted")
    assert [_role(a) for a in mesh.prefill] == ["prefill"]
    # The prefill rate it went by was measured on the prompts the prefill workers computed.
    rate = ("pdmesh_router_prefill_seconds_per_token", (("where", "remote"),))
    assert mesh.router_metrics()[rate] > 0
    # Every stream, including those moved off the switched worker, is the offline engine's.
    want = small_llm.generate(
        [{"prompt_token_ids": p} for p, _, _, _ in done],
        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n, _, _ in done],
    )
    for (_, _, tokens, text), expected in zip(done, want, strict=True):
        assert tokens == expected.outputs[0].token_ids
        assert text == expected.outputs[0].text
