"""Rank 0's step messages to its followers (engine/parallel/step_channel.py): three real processes
in a gloo group, many more messages than the ring has slots, a follower that falls behind now
and then (rank 0 must wait for it before reusing a slot), every follower reading every message in
order; through shared memory (PDMESH_STEP_CHANNEL=shm, as on GPUs) and through the gloo broadcast
(CPUs by default, ranks on several machines)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from pdmesh.engine.parallel.comm import init_group
from pdmesh.engine.parallel.step_channel import SLOTS, StepChannel

MESSAGES = 20 * SLOTS
WORDS = 100


def _message(n: int) -> torch.Tensor:
    return torch.arange(WORDS, dtype=torch.int64) * 1000 + n


def _rank(rank: int, init_method: str, out: str) -> None:
    group = init_group(rank, 3, init_method, torch.device("cpu"), expert_parallel=False)
    channel = StepChannel(group, WORDS)
    ok = []
    for n in range(MESSAGES):
        if rank == 2 and n % 37 == 0:
            time.sleep(0.02)  # behind by more than the ring: rank 0 waits for this rank
        got = channel.broadcast(_message(n) if rank == 0 else None)
        ok.append(bool(torch.equal(got, _message(n))))
    Path(out, f"{rank}.json").write_text(json.dumps({"ok": ok, "shared": channel.shared}))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["shm", "gloo", "auto"])
def test_every_follower_reads_every_message_in_order(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.setenv("PDMESH_STEP_CHANNEL", mode)  # the spawned ranks inherit it
    torch.multiprocessing.spawn(
        _rank, args=(f"tcp://127.0.0.1:{_port()}", str(tmp_path)), nprocs=3, join=True
    )
    for r in range(3):
        result = json.loads((tmp_path / f"{r}.json").read_text())
        assert result["ok"] == [True] * MESSAGES
        # One machine: shared memory when asked; 'auto' keeps gloo on CPUs.
        assert result["shared"] == (mode == "shm")
    assert not list(Path("/dev/shm").glob("pdmesh-step-channel-*"))  # unlinked once mapped


def _rank0_dies(rank: int, init_method: str, out: str) -> None:
    group = init_group(rank, 2, init_method, torch.device("cpu"), expert_parallel=False)
    channel = StepChannel(group, WORDS)
    channel.broadcast(_message(0) if rank == 0 else None)
    if rank == 0:
        os._exit(0)  # gone without a word, its store with it
    start = time.monotonic()
    try:
        channel.broadcast(None)
        error = ""
    except Exception as e:  # what a gloo broadcast from a dead rank raises too
        error = type(e).__name__
    seconds = time.monotonic() - start
    Path(out, "follower.json").write_text(json.dumps({"error": error, "seconds": seconds}))


def test_a_follower_waiting_on_a_dead_rank_0_raises(tmp_path, monkeypatch) -> None:
    """Shared memory has no socket to close: a waiting follower checks rank 0's store about
    once a second, and raises when it is gone (the follower then exits, as over gloo)."""
    monkeypatch.setenv("PDMESH_STEP_CHANNEL", "shm")
    torch.multiprocessing.spawn(
        _rank0_dies, args=(f"tcp://127.0.0.1:{_port()}", str(tmp_path)), nprocs=2, join=True
    )
    result = json.loads((tmp_path / "follower.json").read_text())
    assert result["error"]
    assert result["seconds"] < 10


def _port() -> int:
    from pdmesh.processes import free_port

    return free_port()
