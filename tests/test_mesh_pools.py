"""Two prefill and two decode workers: load spreads, and shared prefixes find their cache."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from mesh_support import Mesh, start_mesh

from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

VOCAB = 512


@pytest.fixture(scope="module")
def mesh(tiny_model) -> Mesh:
    m = start_mesh(
        "--model",
        str(tiny_model("llama")),
        "--prefill",
        "2",
        "--decode",
        "2",
        "--kv-cache-tokens",
        "8192",
        "--disagg-min-tokens",
        "32",
        "--max-model-len",
        "512",
    )
    yield m
    m.stop()


async def _run(target: str, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(p: list[int]) -> list[int]:
            req = gen_pb.GenerateRequest(
                token_ids=gen_pb.TokenIds(ids=p),
                sampling=gen_pb.SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True
                ),
            )
            return [t async for r in stub.Generate(req) for t in r.token_ids]

        return await asyncio.gather(*(one(p) for p in prompts))


def test_every_worker_serves_some_of_40_requests(mesh: Mesh) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(40, 120))] for _ in range(40)]
    before = {a: mesh.stats(a) for a in mesh.prefill + mesh.decode}
    outputs = asyncio.run(_run(mesh.target, prompts))
    assert all(len(o) == 8 for o in outputs)
    for address in mesh.decode:
        s = mesh.stats(address)
        served = (
            s.local_prefills
            + s.remote_prefills
            - (before[address].local_prefills + before[address].remote_prefills)
        )
        assert served > 0, f"decode worker {address} served nothing"
        assert s.kv_blocks_used == 0
    for address in mesh.prefill:
        served = mesh.stats(address).remote_prefills - before[address].remote_prefills
        assert served > 0, f"prefill worker {address} served nothing"


def test_shared_prefix_goes_to_the_prefill_worker_holding_it(mesh: Mesh) -> None:
    rng = random.Random(9)
    prefix = [rng.randrange(VOCAB) for _ in range(256)]
    first = prefix + [rng.randrange(VOCAB) for _ in range(40)]
    asyncio.run(_run(mesh.target, [first]))
    hits = {a: mesh.stats(a).prefix_hit_tokens for a in mesh.prefill}
    served = {a: mesh.stats(a).remote_prefills for a in mesh.prefill}
    for _ in range(3):  # each later request shares the prefix, with a tail long enough to ship
        second = prefix + [rng.randrange(VOCAB) for _ in range(64)]
        asyncio.run(_run(mesh.target, [second]))
    gained = {a: mesh.stats(a).prefix_hit_tokens - hits[a] for a in mesh.prefill}
    holder = max(served, key=lambda a: mesh.stats(a).remote_prefills - served[a])
    # Every later request went to one prefill worker and found the 256-token prefix there.
    assert gained[holder] >= 3 * 256
    other = next(a for a in mesh.prefill if a != holder)
    assert mesh.stats(other).remote_prefills == served[other]
