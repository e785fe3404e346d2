"""The data-parallel ranks' per-step agreement (engine/parallel/host_max.py): three real
processes joined as the front's replicas join (`moe_group`), many rounds of values that differ
per rank and per round, every rank reading the same maxima each round; through shared memory and
through the gloo all-reduce that PDMESH_DP_AGREEMENT=gloo (or ranks on several machines) use."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from pdmesh.engine.data_parallel.group import moe_group

ROUNDS = 2000


def _values(rank: int, r: int) -> list[int]:
    rng = random.Random(r * 31 + rank)
    return [rng.randrange(1000), rng.randrange(2)]


def _rank(rank: int, init_method: str, out: str) -> None:
    group = moe_group(rank, 3, init_method, torch.device("cpu"))
    host_max = group.fast["host_max"]
    # Ranks arrive at different times: the slow one's values must still be the ones read.
    got = []
    for r in range(ROUNDS):
        if r % 97 == rank:
            time.sleep(0.003)
        got.append(host_max(_values(rank, r)))
    left = bool(host_max.segment) and (Path("/dev/shm") / host_max.segment).exists()
    Path(out, f"{rank}.json").write_text(json.dumps({"got": got, "shared": host_max.shared,
                                                     "left": left}))  # fmt: skip
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["auto", "gloo"])
def test_every_rank_reads_the_maxima_of_every_round(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.setenv("PDMESH_DP_AGREEMENT", mode)  # the spawned ranks inherit it
    torch.multiprocessing.spawn(
        _rank, args=(f"tcp://127.0.0.1:{_port()}", str(tmp_path)), nprocs=3, join=True
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    want = [
        [max(_values(rank, r)[i] for rank in range(3)) for i in range(2)] for r in range(ROUNDS)
    ]
    for result in results:
        # One machine: through shared memory unless told to use gloo.
        assert result["shared"] == (mode == "auto")
        assert result["got"] == want
        assert not result["left"]  # the segment's name is gone once every rank mapped it


def _port() -> int:
    from pdmesh.processes import free_port

    return free_port()
