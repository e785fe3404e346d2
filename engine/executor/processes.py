"""Follower ranks as local processes (`python -m pdmesh.engine.executor.follower`), each started
with its spec as JSON in its environment, as a fork of a warm interpreter where it can be
(pdmesh/warm_start.py), and dying with the process that started it."""

from __future__ import annotations

import dataclasses
import os
import subprocess

from pdmesh.engine.executor.base import FollowerSpec
from pdmesh.warm_start import Process, start_module


def spawn_follower(spec: FollowerSpec) -> Process:
    env = {**os.environ, "PDMESH_TP_SPEC": spec.to_json()}
    return start_module("pdmesh.engine.executor.follower", [], env)


class LocalRanks:
    """Some of a worker's ranks as processes of this node: `ranks` (global), the first of them
    on local rank `first_local`'s device."""

    def __init__(self, spec: FollowerSpec, ranks: range, first_local: int) -> None:
        self.procs: dict[int, Process] = {}
        for i, rank in enumerate(ranks):
            rank_spec = dataclasses.replace(spec, rank=rank, local_rank=first_local + i)
            self.procs[rank] = spawn_follower(rank_spec)

    def exited(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first rank found exited, or None."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def failed(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first rank found exited with an error, or None."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None and code != 0:
                return rank, code
        return None

    def clean(self) -> bool:
        """Whether every rank has exited with code 0 (told to stop)."""
        return all(p.poll() == 0 for p in self.procs.values())

    def stop(self, timeout_s: float) -> None:
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def terminate(self) -> None:
        """End them now (SIGTERM), without waiting."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
