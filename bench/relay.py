"""The router's relay capacity: how many tokens/s it can stream to clients when decode is free.

K token sources (bench/token_source.py: the DecodeWorker protocol with no model) feed a real
router process (`pdmesh router --decode ...`, default model for its tokenizer, no prefill
workers); C concurrent gRPC clients in this process stream requests of `output_len` tokens from
it back to back. After a warm-up, tokens and messages are counted at the clients over a fixed
window, with the CPU time of every process (everything shares this machine's cores).

    pdmesh bench --relay [--clients 256 --sources 2 --output-len 512 --duration 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from pdmesh.bench.report import cpu_seconds, device_name, machine_busy_seconds, write_json_out
from pdmesh.bench.serving import exact_request
from pdmesh.flags import from_args
from pdmesh.mesh import pdmesh_command, wait_for_workers
from pdmesh.processes import free_port
from pdmesh.serving.grpc_server import channel
from pdmesh.supervisor import Child, ProcessSpec, spawn, stop_all
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

HOST = "127.0.0.1"
PROMPT = list(range(1000, 1016))  # 16 tokens: one block, cheap to hash and ship
CHANNELS = 4  # client connections; streams are spread over them
READY_TIMEOUT_S = 300.0


@dataclass
class Counts:
    tokens: int = 0
    messages: int = 0
    finished: int = 0
    errors: list[str] = field(default_factory=list)
    bad_finishes: int = 0  # ended with the wrong token count or finish reason


@dataclass(frozen=True)
class RelayConfig:
    clients: int = 256
    sources: int = 2
    output_len: int = 512
    duration_s: float = 20.0
    warmup_s: float = 3.0
    step_ms: float = 1.0
    model: str | None = None

    def __post_init__(self) -> None:
        for name in ("clients", "sources", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.step_ms < 0:
            raise ValueError("duration must be > 0, warmup and step-ms >= 0.")


@dataclass
class RelayResult:
    clients: int
    sources: int
    output_len: int
    duration_s: float
    tokens_per_s: float
    messages_per_s: float
    tokens_per_message: float
    requests_per_s: float
    cpu_cores_used: dict[str, float]
    cpu_count: int
    device: str
    date: str
    errors: int
    bad_finishes: int


def start_processes(cfg: RelayConfig) -> tuple[list[Child], str]:
    """`cfg.sources` token sources and a router in front of them: the children and the router's
    address."""
    children: list[Child] = []
    decode: list[str] = []
    for i in range(cfg.sources):
        port = free_port(HOST)
        argv = [
            sys.executable, "-m", "pdmesh.bench.token_source",
            "--host", HOST, "--port", str(port), "--step-ms", str(cfg.step_ms),
        ]  # fmt: skip
        children.append(spawn(ProcessSpec(f"source-{i}", argv, f"{HOST}:{port}", quiet=True)))
        decode.append(f"{HOST}:{port}")
    port = free_port(HOST)
    argv = pdmesh_command(
        "router", "--host", HOST, "--port", str(port), "--http-port", "0",
        "--decode", ",".join(decode),
    )  # fmt: skip
    if cfg.model:
        argv += ["--model", cfg.model]
    env = {**os.environ, "PDMESH_LOG_LEVEL": "WARNING"}
    children.append(spawn(ProcessSpec("router", argv, f"{HOST}:{port}", env=env)))
    return children, f"{HOST}:{port}"


async def client(
    stub: generation_pb2_grpc.GenerationStub, output_len: int, stop_at: float, counts: Counts
) -> None:
    loop = asyncio.get_running_loop()
    request = exact_request(PROMPT, output_len)
    while loop.time() < stop_at:
        received = 0
        try:
            async for r in stub.Generate(request):
                n = len(r.token_ids)
                received += n
                counts.tokens += n
                counts.messages += 1
                if r.finish_reason:
                    counts.finished += 1
                    if (
                        received != output_len
                        or r.finish_reason != gen_pb.FINISH_REASON_LENGTH
                        or r.usage.completion_tokens != output_len
                    ):
                        counts.bad_finishes += 1
        except grpc.aio.AioRpcError as e:
            counts.errors.append(f"{e.code().name}: {e.details()}")
            await asyncio.sleep(0.1)


async def drive(cfg: RelayConfig, target: str, pids: dict[str, int]) -> RelayResult:
    """Clients stream for warm-up + duration; the window's counts make the result."""
    channels = [channel(target) for _ in range(CHANNELS)]
    stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
    loop = asyncio.get_running_loop()
    counts = Counts()
    stop_at = loop.time() + cfg.warmup_s + cfg.duration_s
    tasks = [
        asyncio.create_task(client(stubs[i % CHANNELS], cfg.output_len, stop_at, counts))
        for i in range(cfg.clients)
    ]
    await asyncio.sleep(cfg.warmup_s)
    start = (loop.time(), counts.tokens, counts.messages, counts.finished)
    cpu_start = {name: cpu_seconds(pid) for name, pid in pids.items()}
    machine_start = machine_busy_seconds()
    await asyncio.sleep(cfg.duration_s)
    elapsed = loop.time() - start[0]
    tokens, messages, finished = (
        counts.tokens - start[1], counts.messages - start[2], counts.finished - start[3]
    )  # fmt: skip
    cpu = {name: (cpu_seconds(pid) - cpu_start[name]) / elapsed for name, pid in pids.items()}
    machine = (machine_busy_seconds() - machine_start) / elapsed
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close()
    cpu["total"] = sum(cpu.values())
    cpu["other_processes"] = max(0.0, machine - cpu["total"])
    return RelayResult(
        clients=cfg.clients,
        sources=cfg.sources,
        output_len=cfg.output_len,
        duration_s=round(elapsed, 2),
        tokens_per_s=round(tokens / elapsed, 1),
        messages_per_s=round(messages / elapsed, 1),
        tokens_per_message=round(tokens / max(1, messages), 2),
        requests_per_s=round(finished / elapsed, 2),
        cpu_cores_used={k: round(v, 2) for k, v in cpu.items()},
        cpu_count=os.cpu_count() or 0,
        device=device_name(),
        date=time.strftime("%Y-%m-%d"),
        errors=len(counts.errors),
        bad_finishes=counts.bad_finishes,
    )


def run_relay(cfg: RelayConfig) -> RelayResult:
    children, target = start_processes(cfg)
    try:
        wait_for_workers(target, 0, cfg.sources, children, READY_TIMEOUT_S)
        pids = {c.name: c.proc.pid for c in children}
        pids["clients"] = os.getpid()
        return asyncio.run(drive(cfg, target, pids))
    finally:
        stop_all(children)


def run_relay_bench(args: argparse.Namespace) -> int:
    cfg = from_args(
        RelayConfig,
        args,
        output_len=args.output_len or 512,
        duration_s=args.duration,
        warmup_s=args.warmup,
    )
    result = run_relay(cfg)
    cores = ", ".join(f"{k} {v:.2f}" for k, v in result.cpu_cores_used.items())
    print(
        f"relay: {result.tokens_per_s:,.0f} tokens/s to {cfg.clients} clients "
        f"({result.messages_per_s:,.0f} messages/s, {result.tokens_per_message:.1f} tokens per "
        f"message, {result.requests_per_s:.1f} requests/s) over {result.duration_s:.0f} s\n"
        f"CPU cores used ({result.cpu_count} cores): {cores}"
    )
    if result.errors or result.bad_finishes:
        print(f"errors: {result.errors}, wrong finishes: {result.bad_finishes}", file=sys.stderr)
    write_json_out(args.json_out, asdict(result))
    return 1 if result.errors or result.bad_finishes else 0
