"""Soak: mixed streaming load held at a share of the decode workers' KV capacity, with random
cancellations, for a fixed time. Afterwards every request must have completed (its finish
reason, usage and token count agreeing) or been cancelled by the client, no KV block may be in
use on any worker, and the services' resident memory must not have grown.

The load is closed-loop on the KV cache: a new request starts whenever the decode workers' blocks
in use (polled) plus those of requests not yet visible in that figure leave room under
`kv_target` of their capacity (and what is in flight could not overrun the cache by much).

    pdmesh bench --soak [--duration 600] [--kv-target 0.8] [--model M --kv-cache-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from pdmesh.bench.report import write_json_out
from pdmesh.flags import engine_argv, engine_options
from pdmesh.mesh import quiet_up, read_services
from pdmesh.processes import free_port
from pdmesh.supervisor import stop
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

STATS_INTERVAL_S = 0.05
# In-flight requests' worst cases (every token they may generate) may add up to this much of the
# cache: cancellations and early stops mean they never all reach it, so usage can sit near the
# target; where they would, the decode worker preempts (and recomputes) the newest.
OVERCOMMIT = 1.5
DRAIN_TIMEOUT_S = 300.0  # once the load stops, in-flight requests must finish within this
LEAK_WAIT_S = 10.0


@dataclass(frozen=True)
class SoakConfig:
    target: str  # the router's gRPC address
    decode: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    duration_s: float = 60.0
    kv_target: float = 0.8
    prompt_len: tuple[int, int] = (16, 256)
    max_tokens: tuple[int, int] = (8, 128)
    cancel_fraction: float = 0.2
    vocab_size: int = 512
    seed: int = 0
    pids: tuple[int, ...] = ()  # processes whose resident memory is watched
    warmup_s: float = 0.0  # the memory baseline is taken this far into the run

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("a soak needs the decode workers' addresses (their KV capacity).")
        if not 0 < self.kv_target <= 1:
            raise ValueError(f"kv_target must be in (0, 1], got {self.kv_target!r}.")
        if not 0 <= self.cancel_fraction <= 1:
            raise ValueError(f"cancel_fraction must be in [0, 1], got {self.cancel_fraction!r}.")
        if self.duration_s <= 0 or not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("duration_s must be > 0 and warmup_s in [0, duration_s).")
        for name in ("prompt_len", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)!r}.")


@dataclass
class SoakResult:
    """What a soak saw; `ok` when nothing failed and no block leaked (the caller judges
    `rss_growth` against its own bound)."""

    duration_s: float = 0.0
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, verbatim
    failed: int = 0
    kv_blocks_total: int = 0
    kv_usage_mean: float = 0.0  # share of the decode workers' blocks in use, over the run
    kv_usage_peak: float = 0.0
    leaked_blocks: dict[str, int] = field(default_factory=dict)  # worker -> blocks still used
    rss_start: dict[int, int] = field(default_factory=dict)  # pid -> bytes, after the warm-up
    rss_end: dict[int, int] = field(default_factory=dict)

    @property
    def rss_growth(self) -> dict[int, float]:
        return {p: self.rss_end[p] / self.rss_start[p] - 1 for p in self.rss_start}

    @property
    def ok(self) -> bool:
        return self.failed == 0 and not any(self.leaked_blocks.values())

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "rss_growth": self.rss_growth, "ok": self.ok}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


async def _stats(stub: object) -> worker_pb2.WorkerStats:
    return await stub.GetStats(worker_pb2.StatsRequest(), timeout=5)  # type: ignore[attr-defined]


class _Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.result = SoakResult()
        self.used = 0  # decode blocks in use at the last poll
        self.fresh = 0  # blocks of requests started since that poll
        self.reserved = 0  # worst-case blocks of the requests in flight
        self.block_size = 16
        self.samples: list[float] = []

    def _fail(self, message: str) -> None:
        self.result.failed += 1
        if len(self.result.failures) < 10:
            self.result.failures.append(message)

    async def one(
        self, stub: generation_pb2_grpc.GenerationStub, prompt_len: int, max_tokens: int
    ) -> None:
        cfg, rng = self.cfg, self.rng
        worst = self._blocks(prompt_len + max_tokens)
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(prompt_len)]
        # Cancel after k received tokens (k = 0: before the first, during prefill or queueing).
        cancel_at = rng.randint(0, max_tokens - 1) if rng.random() < cfg.cancel_fraction else None
        req = gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=prompt),
            sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9),
        )
        self.result.requests += 1
        # No deadline: under load with preemptions a request may take long, and that is allowed;
        # one that never ends is caught when the load stops (DRAIN_TIMEOUT_S).
        call = stub.Generate(req)
        received, last, cancelled = 0, None, False
        try:
            if cancel_at == 0:
                await asyncio.sleep(rng.random() * 0.05)
                cancelled = call.cancel()
            async for r in call:
                received += len(r.token_ids)
                last = r
                if cancel_at is not None and received >= cancel_at and not r.finish_reason:
                    cancelled = call.cancel()
                    break
        except grpc.aio.AioRpcError as e:
            if not (cancelled and e.code() is grpc.StatusCode.CANCELLED):
                self._fail(f"{e.code().name}: {e.details()}")
                return
        except asyncio.CancelledError:
            if not cancelled:
                raise
        finally:
            self.reserved -= worst
        self.result.tokens += received
        if cancelled and (last is None or not last.finish_reason):
            self.result.cancelled += 1
        elif last is None or not last.finish_reason:
            self._fail("the stream ended without a finish reason")
        elif last.usage.completion_tokens != received or received > max_tokens:
            self._fail(f"{received} tokens, usage says {last.usage.completion_tokens}")
        else:
            self.result.completed += 1

    async def poll(self, stubs: list[object], capacity: list[int]) -> None:
        while True:
            stats = await asyncio.gather(*(_stats(s) for s in stubs))
            self.used = sum(s.kv_blocks_used for s in stats)
            self.fresh = 0
            capacity[:] = [sum(s.kv_blocks_total for s in stats)]
            self.block_size = stats[0].block_size or self.block_size
            self.samples.append(self.used / max(1, capacity[0]))
            await asyncio.sleep(STATS_INTERVAL_S)

    async def run(self) -> SoakResult:
        cfg = self.cfg
        async with contextlib.AsyncExitStack() as stack:
            router = await stack.enter_async_context(grpc.aio.insecure_channel(cfg.target))
            gen = generation_pb2_grpc.GenerationStub(router)
            workers: dict[str, object] = {}  # address -> stub
            stubs = [(a, worker_pb2_grpc.DecodeWorkerStub) for a in cfg.decode]
            stubs += [(a, worker_pb2_grpc.PrefillWorkerStub) for a in cfg.prefill]
            for a, stub in stubs:
                ch = await stack.enter_async_context(grpc.aio.insecure_channel(a))
                workers[a] = stub(ch)
            capacity = [0]
            decode = [workers[a] for a in cfg.decode]
            poller = asyncio.create_task(self.poll(decode, capacity))
            tasks: set[asyncio.Task[None]] = set()
            next_request: tuple[int, int] | None = None
            start = time.monotonic()
            while (now := time.monotonic()) - start < cfg.duration_s:
                if not self.result.rss_start and now - start >= cfg.warmup_s:
                    self.result.rss_start = {p: rss_bytes(p) for p in cfg.pids}
                if next_request is None:
                    next_request = (
                        self.rng.randint(*cfg.prompt_len),
                        self.rng.randint(*cfg.max_tokens),
                    )
                if (nxt := self._admit(next_request, capacity[0])) is not None:
                    task = asyncio.create_task(self.one(gen, *nxt))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    next_request = None
                    continue
                await asyncio.sleep(0.01)
            self.result.duration_s = time.monotonic() - start
            if tasks:
                _, stuck = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
                for task in stuck:
                    self._fail(f"still running {DRAIN_TIMEOUT_S:.0f} s after the load stopped")
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
            poller.cancel()
            self.result.kv_blocks_total = capacity[0]
            self.result.leaked_blocks = await self._leaks(workers)
        if self.samples:
            self.result.kv_usage_mean = sum(self.samples) / len(self.samples)
            self.result.kv_usage_peak = max(self.samples)
        self.result.rss_end = {p: rss_bytes(p) for p in cfg.pids}
        return self.result

    def _admit(self, request: tuple[int, int], capacity: int) -> tuple[int, int] | None:
        """The request, if it fits now: its prompt under the usage target, and the worst cases
        in flight within OVERCOMMIT of the cache."""
        prompt_len, max_tokens = request
        now, worst = self._blocks(prompt_len), self._blocks(prompt_len + max_tokens)
        room = self.cfg.kv_target * capacity - self.used - self.fresh
        if not capacity or room < now or self.reserved + worst > OVERCOMMIT * capacity:
            return None
        self.fresh += now
        self.reserved += worst
        return request

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    async def _leaks(self, stubs: dict[str, object]) -> dict[str, int]:
        """Blocks still in use on each worker once the load is over (cancellations are
        asynchronous: they get a few seconds to land)."""
        deadline = time.monotonic() + LEAK_WAIT_S
        while True:
            used = {a: (await _stats(s)).kv_blocks_used for a, s in stubs.items()}
            if not any(used.values()) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.1)


def run_soak(cfg: SoakConfig) -> SoakResult:
    return asyncio.run(_Soak(cfg).run())


# -- `pdmesh bench --soak`: a mesh of its own, the soak, the verdict ----------------------------
MAX_RSS_GROWTH = 0.05
ROLES = ("prefill", "decode")


def _start_mesh(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen[str], SoakConfig]:
    cmd = quiet_up(port, "--prefill", "1", "--decode", "1", *engine_argv(engine_options(args)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        services = read_services(proc.stdout)
    except RuntimeError:
        raise RuntimeError(f"pdmesh up exited with code {proc.wait()}") from None
    workers = {role: tuple(s.address for s in services if s.role == role) for role in ROLES}
    target = f"127.0.0.1:{port}"
    with grpc.insecure_channel(target) as ch:
        info = generation_pb2_grpc.GenerationStub(ch).GetModelInfo(gen_pb.ModelInfoRequest())
    cfg = SoakConfig(
        target=target,
        decode=workers["decode"],
        prefill=workers["prefill"],
        duration_s=args.duration,
        kv_target=args.kv_target,
        cancel_fraction=args.cancel_fraction,
        vocab_size=info.vocab_size,
        pids=tuple(s.pid for s in services),
        warmup_s=min(60.0, args.duration / 10),
    )
    return proc, cfg


def run_soak_bench(args: argparse.Namespace) -> int:
    proc, cfg = _start_mesh(args, free_port("127.0.0.1"))
    try:
        print(f"soak: {cfg.duration_s:.0f} s at {cfg.kv_target:.0%} of KV capacity", flush=True)
        result = run_soak(cfg)
    finally:
        stop(proc, 60)
    growth = result.rss_growth
    print(
        f"requests {result.requests}: completed {result.completed}, cancelled "
        f"{result.cancelled}, failed {result.failed}; {result.tokens} tokens in "
        f"{result.duration_s:.0f} s\nKV usage: mean {result.kv_usage_mean:.0%}, peak "
        f"{result.kv_usage_peak:.0%} of {result.kv_blocks_total} blocks; leaked blocks "
        f"{result.leaked_blocks}\nresident memory growth: "
        + ", ".join(f"pid {p} {g:+.1%}" for p, g in growth.items())
    )
    for failure in result.failures:
        print(f"  failure: {failure}")
    write_json_out(args.json_out, result.as_dict())
    return 0 if result.ok and all(g < MAX_RSS_GROWTH for g in growth.values()) else 1
