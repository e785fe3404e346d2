"""A mesh of pdmesh processes on this machine for the CPU benches that move running streams
(`migration_cpu`, `role_switch_cpu`): each service a process with its own port and log, waits
on their state, and greedy streams recorded chunk by chunk as a client sees them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from pdmesh.healthcheck import SERVING, check
from pdmesh.processes import free_port
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

Chunks = list[tuple[float, int]]  # (arrival time, tokens) of each response of a stream


class Proc:
    """`pdmesh ROLE --port P ARGV...` on a free port, its output in `log`."""

    def __init__(self, role: str, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "PDMESH_LOG_LEVEL": "WARNING"}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdmesh.cli", role, "--port", str(self.port), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def serving(self) -> bool:
        return check(self.address, timeout_s=2)[0] == SERVING

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stats(self) -> worker_pb2.WorkerStats:
        with grpc.insecure_channel(self.address) as ch:
            return worker_pb2_grpc.DecodeWorkerStub(ch).GetStats(worker_pb2.StatsRequest())


def until(what: str, predicate: Any, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def decode_workers_ready(router: str) -> int:
    """Decode workers in the router's rotation (-1: the router does not answer)."""
    with grpc.insecure_channel(router) as ch:
        try:
            info = generation_pb2_grpc.GenerationStub(ch).GetModelInfo(
                gen_pb.ModelInfoRequest(), timeout=2
            )
        except grpc.RpcError:
            return -1
    return info.num_decode_workers


async def record_stream(
    stub: generation_pb2_grpc.GenerationStub,
    prompt: list[int],
    max_tokens: int,
    chunks: Chunks,
    tokens: list[int],
) -> None:
    """One greedy ignore-EOS request: each response's arrival and size onto `chunks`, its
    tokens onto `tokens`, as they come."""
    req = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt),
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    async for r in stub.Generate(req, timeout=900):
        chunks.append((time.monotonic(), len(r.token_ids)))
        tokens += r.token_ids
