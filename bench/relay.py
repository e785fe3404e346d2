"""The router's relay capacity: how many tokens/s it can stream to clients when decode is free,
and what each streamed token costs the router's CPU.

K token sources (bench/token_source.py: the DecodeWorker protocol with no model) feed a real
router process (`pdmesh router --decode ...`, default model for its tokenizer, no prefill
workers); C concurrent clients in this process stream requests of `output_len` tokens from
it back to back. After a warm-up, tokens and messages are counted at the clients over a fixed
window, with the CPU time of every process (everything shares this machine's cores); the
router's CPU time divided by the tokens streamed is its cost per token. Its CPU with no client
(health checks and load polls of its workers) is measured first, for `idle_s`, and the cost per
token is also given above that idle rate: at a few dozen tokens/s the polls weigh as much as
the tokens.

`--colocated`: one real decode worker on the model (what `pdmesh up --colocated` runs: it
prefills itself) feeds the router instead. `--http`: the clients stream `/v1/completions`
over SSE from the router's OpenAI gateway (tokens counted from each request's usage when it
ends) instead of gRPC `Generate`.

    pdmesh bench --relay [--clients 256 --sources 2 --output-len 512 --duration 20]
    pdmesh bench --relay --colocated [--http] --clients 8 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import grpc

from pdmesh.bench.report import (
    cpu_seconds,
    device_name,
    machine_busy_seconds,
    thread_cpu_seconds,
    write_json_out,
)
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
    idle_s: float = 5.0  # the router's CPU with no client, measured first
    step_ms: float = 1.0
    model: str | None = None
    colocated: bool = False  # a decode worker on the model instead of token sources
    http: bool = False  # clients stream SSE from the gateway instead of gRPC

    def __post_init__(self) -> None:
        for name in ("clients", "sources", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.duration_s <= 0 or min(self.warmup_s, self.idle_s, self.step_ms) < 0:
            raise ValueError("duration must be > 0, warmup, idle and step-ms >= 0.")


@dataclass
class RelayResult:
    clients: int
    sources: int
    output_len: int
    duration_s: float
    source: str  # "token sources" | "decode worker on the model"
    edge: str  # "grpc" | "http"
    tokens_per_s: float
    router_cpu_us_per_token: float
    router_idle_cores: float  # with no client
    router_cpu_us_per_token_above_idle: float
    messages_per_s: float
    tokens_per_message: float
    requests_per_s: float
    cpu_cores_used: dict[str, float]
    cpu_count: int
    device: str
    date: str
    errors: int
    bad_finishes: int


def start_processes(cfg: RelayConfig) -> tuple[list[Child], str, str]:
    """`cfg.sources` token sources (or, colocated, one decode worker on the model) and a router
    in front of them: the children, the router's gRPC address and its gateway's URL ("" unless
    `cfg.http`)."""
    children: list[Child] = []
    decode: list[str] = []
    model = ["--model", cfg.model] if cfg.model else []
    env = {**os.environ, "PDMESH_LOG_LEVEL": "WARNING"}
    for i in range(1 if cfg.colocated else cfg.sources):
        port = free_port(HOST)
        if cfg.colocated:
            argv = pdmesh_command("decode", "--host", HOST, "--port", str(port), *model)
            spec = ProcessSpec("decode-0", argv, f"{HOST}:{port}", env=env, quiet=True)
        else:
            argv = [
                sys.executable, "-m", "pdmesh.bench.token_source",
                "--host", HOST, "--port", str(port), "--step-ms", str(cfg.step_ms),
            ]  # fmt: skip
            spec = ProcessSpec(f"source-{i}", argv, f"{HOST}:{port}", quiet=True)
        children.append(spawn(spec))
        decode.append(f"{HOST}:{port}")
    port = free_port(HOST)
    http_port = free_port(HOST) if cfg.http else 0
    argv = pdmesh_command(
        "router", "--host", HOST, "--port", str(port), "--http-port", str(http_port),
        "--decode", ",".join(decode), *model,
    )  # fmt: skip
    children.append(spawn(ProcessSpec("router", argv, f"{HOST}:{port}", env=env)))
    http = f"http://{HOST}:{http_port}" if cfg.http else ""
    return children, f"{HOST}:{port}", http


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


async def http_client(
    session: aiohttp.ClientSession, url: str, output_len: int, stop_at: float, counts: Counts
) -> None:
    """As `client`, over SSE: a message is an event with a choice; a request's tokens are
    counted from the usage of its last event (SSE events carry text, not token ids)."""
    loop = asyncio.get_running_loop()
    body = {
        "prompt": PROMPT,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    while loop.time() < stop_at:
        try:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    counts.errors.append(f"HTTP {response.status}: {await response.text()}")
                    await asyncio.sleep(0.1)
                    continue
                reason = None
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event["choices"]:
                        counts.messages += 1
                        reason = event["choices"][0]["finish_reason"] or reason
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                        counts.tokens += tokens
                        counts.finished += 1
                        counts.bad_finishes += tokens != output_len or reason != "length"
        except aiohttp.ClientError as e:
            counts.errors.append(repr(e))
            await asyncio.sleep(0.1)


async def drive(cfg: RelayConfig, target: str, http: str, pids: dict[str, int]) -> RelayResult:
    """The router idles for `idle_s`, then clients stream for warm-up + duration; the window's
    counts make the result."""
    router = pids["router"]
    idle_start = thread_cpu_seconds(router)
    await asyncio.sleep(cfg.idle_s)
    idle_cores = (thread_cpu_seconds(router) - idle_start) / cfg.idle_s if cfg.idle_s else 0.0
    channels = [channel(target) for _ in range(CHANNELS)]
    stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )
    loop = asyncio.get_running_loop()
    counts = Counts()
    stop_at = loop.time() + cfg.warmup_s + cfg.duration_s
    url = f"{http}/v1/completions"
    tasks = [
        asyncio.create_task(
            http_client(session, url, cfg.output_len, stop_at, counts)
            if cfg.http
            else client(stubs[i % CHANNELS], cfg.output_len, stop_at, counts)
        )
        for i in range(cfg.clients)
    ]
    await asyncio.sleep(cfg.warmup_s)
    start = (loop.time(), counts.tokens, counts.messages, counts.finished)
    cpu_start = {name: cpu_seconds(pid) for name, pid in pids.items()}
    router_start = thread_cpu_seconds(router)
    machine_start = machine_busy_seconds()
    await asyncio.sleep(cfg.duration_s)
    elapsed = loop.time() - start[0]
    tokens, messages, finished = (
        counts.tokens - start[1], counts.messages - start[2], counts.finished - start[3]
    )  # fmt: skip
    cpu = {name: (cpu_seconds(pid) - cpu_start[name]) / elapsed for name, pid in pids.items()}
    router_cpu_s = thread_cpu_seconds(router) - router_start
    machine = (machine_busy_seconds() - machine_start) / elapsed
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close()
    await session.close()
    cpu["total"] = sum(cpu.values())
    cpu["other_processes"] = max(0.0, machine - cpu["total"])
    return RelayResult(
        clients=cfg.clients,
        sources=cfg.sources,
        output_len=cfg.output_len,
        duration_s=round(elapsed, 2),
        source="decode worker on the model" if cfg.colocated else "token sources",
        edge="http" if cfg.http else "grpc",
        tokens_per_s=round(tokens / elapsed, 1),
        router_cpu_us_per_token=round(router_cpu_s / max(1, tokens) * 1e6, 1),
        router_idle_cores=round(idle_cores, 4),
        router_cpu_us_per_token_above_idle=round(
            (router_cpu_s - idle_cores * elapsed) / max(1, tokens) * 1e6, 1
        ),
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
    children, target, http = start_processes(cfg)
    try:
        decode = 1 if cfg.colocated else cfg.sources
        wait_for_workers(target, 0, decode, children, READY_TIMEOUT_S)
        pids = {c.name: c.proc.pid for c in children}
        pids["clients"] = os.getpid()
        return asyncio.run(drive(cfg, target, http, pids))
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
        f"message, {result.requests_per_s:.1f} requests/s) over {result.duration_s:.0f} s, "
        f"{result.edge} from {result.source}\n"
        f"router CPU per streamed token: {result.router_cpu_us_per_token:.0f} us "
        f"({result.router_cpu_us_per_token_above_idle:.0f} us above its idle "
        f"{result.router_idle_cores * 1e3:.1f} ms/s)\n"
        f"CPU cores used ({result.cpu_count} cores): {cores}"
    )
    if result.errors or result.bad_finishes:
        print(f"errors: {result.errors}, wrong finishes: {result.bad_finishes}", file=sys.stderr)
    write_json_out(args.json_out, asdict(result))
    return 1 if result.errors or result.bad_finishes else 0
