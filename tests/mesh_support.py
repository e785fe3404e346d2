"""Running a real mesh for tests: `pdmesh up` as a subprocess, as a user runs it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.bench.serving import exact_request
from pdmesh.mesh import quiet_up, read_services
from pdmesh.processes import free_port
from pdmesh.supervisor import stop
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Mesh:
    proc: subprocess.Popen[str]
    target: str  # the router's gRPC address
    http: str | None  # the gateway's base URL
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    kvstore: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)

    def stats(self, address: str) -> worker_pb2.WorkerStats:
        with grpc.insecure_channel(address) as ch:
            stub_cls = (
                worker_pb2_grpc.PrefillWorkerStub
                if address in self.prefill
                else worker_pb2_grpc.DecodeWorkerStub
            )
            return stub_cls(ch).GetStats(worker_pb2.StatsRequest(), timeout=10)

    def blocks_used(self) -> tuple[int, int]:
        """KV blocks the first decode and the first prefill worker hold."""
        return self.stats(self.decode[0]).kv_blocks_used, self.stats(self.prefill[0]).kv_blocks_used

    def wait_blocks_free(self, within_s: float) -> float:
        """Seconds until neither holds a block; AssertionError after `within_s`."""
        start = time.monotonic()
        while (used := self.blocks_used()) != (0, 0):
            assert time.monotonic() - start < within_s, f"blocks still used: {used}"
            time.sleep(0.05)
        return time.monotonic() - start

    def stop(self) -> None:
        stop(self.proc, 30)

    def router_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The router's /metrics (on its HTTP gateway): (sample name, sorted labels) -> value."""
        assert self.http is not None, "the mesh was started without HTTP"
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as r:
            families = text_string_to_metric_families(r.read().decode())
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for f in families
                for s in f.samples
            }


def start_mesh(*args: str, http: bool = False, model: Path | None = None) -> Mesh:
    """`pdmesh up ARGS` on free ports (`--model MODEL` when given); returns once it says it
    is up."""
    if model is not None:
        args = ("--model", str(model), *args)
    port = free_port()
    http_port = free_port() if http else 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDMESH_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        quiet_up(port, *args, http_port=http_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    mesh = Mesh(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}" if http else None)
    assert proc.stdout is not None
    try:
        services = read_services(proc.stdout, mesh.output.append)
    except RuntimeError:
        mesh.stop()
        raise RuntimeError("pdmesh up exited:\n" + "".join(mesh.output[-40:])) from None
    for service in services:
        if service.role != "router":
            getattr(mesh, service.role).append(service.address)
        mesh.pids[service.address] = service.pid
    return mesh


async def greedy_tokens(
    target: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 120
) -> list[list[int]]:
    """Greedy (ignore_eos) completions of token-id prompts, all at once, through a router."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(p: list[int]) -> list[int]:
            req = exact_request(p, max_tokens)
            return [t async for r in stub.Generate(req, timeout=timeout_s) for t in r.token_ids]

        return await asyncio.gather(*(one(p) for p in prompts))


def assert_layouts_crossed(
    mesh: Mesh, prompts: list[list[int]], prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    """Every prompt went through the prefill worker, whose (TP, PP) layout is `prefill` and the
    decode worker's `decode`, and each head of each block crossed once (the tiny Llama: 2 layers,
    2 KV heads of 16 dims, fp32, blocks of 16 tokens)."""
    d, p = mesh.stats(mesh.decode[0]), mesh.stats(mesh.prefill[0])
    assert d.remote_prefills == len(prompts) and d.prefill_fallbacks == 0
    assert (p.tensor_parallel_size, p.pipeline_parallel_size) == prefill
    assert (d.tensor_parallel_size, d.pipeline_parallel_size) == decode
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K+V) x tokens x KV heads x dims x fp32
    blocks = sum(-(-len(x) // 16) for x in prompts)
    assert d.kv_bytes_received == p.kv_bytes_sent == blocks * block_bytes
    assert d.kv_blocks_used == 0
