"""Two prefill and two decode workers: load spreads, and shared prefixes find their cache."""

from __future__ import annotations

import asyncio
import random

import pytest
from mesh_support import Mesh, greedy_tokens, start_mesh

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


def test_every_worker_serves_some_of_40_requests(mesh: Mesh) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(40, 120))] for _ in range(40)]
    before = {a: mesh.stats(a) for a in mesh.prefill + mesh.decode}
    outputs = asyncio.run(greedy_tokens(mesh.target, prompts, 8))
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
    asyncio.run(greedy_tokens(mesh.target, [first], 8))
    hits = {a: mesh.stats(a).prefix_hit_tokens for a in mesh.prefill}
    served = {a: mesh.stats(a).remote_prefills for a in mesh.prefill}
    for _ in range(3):  # each later request shares the prefix, with a tail long enough to ship
        second = prefix + [rng.randrange(VOCAB) for _ in range(64)]
        asyncio.run(greedy_tokens(mesh.target, [second], 8))
    gained = {a: mesh.stats(a).prefix_hit_tokens - hits[a] for a in mesh.prefill}
    holder = max(served, key=lambda a: mesh.stats(a).remote_prefills - served[a])
    # Every later request went to one prefill worker and found the 256-token prefix there.
    assert gained[holder] >= 3 * 256
    other = next(a for a in mesh.prefill if a != holder)
    assert mesh.stats(other).remote_prefills == served[other]
