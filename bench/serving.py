"""The serving benchmark: requests streamed from a router over gRPC, as vLLM's benchmark_serving.

Workload (fixed seed): N requests of random token ids (prompts drawn from ordinary ids), prompt
and output lengths uniform in len * [1 - r, 1 + r], ignore_eos and temperature 0 so every
request produces exactly its length. Arrivals: Poisson at --request-rate (or evenly spaced with
--arrivals constant; inf sends all at once), at most --concurrency in flight. Each request is
one `pdmesh.v1.Generation/Generate` stream; the client timestamps every message. Prompts repeat
for a given --seed: a second run against the same mesh hits its prefix cache (restart the mesh,
or change --seed, to measure prefill again).

    pdmesh bench --target 127.0.0.1:50051 --num-requests 32 --input-len 192 --output-len 96 \
        --range-ratio 0.33 [--request-rate 4] [--slo-ttft-ms 500 --slo-tpot-ms 100] [--plot x.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from pdmesh.bench.latency_stats import RequestRecord, Slo, summarize
from pdmesh.bench.report import device_name, write_json_out
from pdmesh.flags import from_args
from pdmesh.serving.convert import FINISH_FROM_PB
from pdmesh.serving.grpc_server import channel
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

LOWEST_PROMPT_ID = 1000  # below this, vocabularies keep their special and byte tokens
REQUEST_TIMEOUT_S = 3600.0
WARMUP_TOKENS = 4
WARMUP_PROMPT_LEN = 32


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    warmup_prompt: list[int]  # shares no prefix with the prompts: warms nothing in the cache


@dataclass(frozen=True)
class LoadConfig:
    num_requests: int
    input_len: int
    output_len: int
    request_rate: float  # req/s; inf: all at once
    range_ratio: float = 0.0
    arrivals: str = "poisson"  # | "constant"
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}.")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1.")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}.")
        if not self.request_rate > 0:
            raise ValueError(
                f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}."
            )
        if self.arrivals not in ("poisson", "constant"):
            raise ValueError(f"--arrivals must be poisson or constant, got {self.arrivals!r}.")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}.")


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(cfg: LoadConfig, vocab_size: int) -> Workload:
    rng = random.Random(cfg.seed)
    low = min(LOWEST_PROMPT_ID, vocab_size // 4)
    in_lens = _lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_requests)
    out_lens = _lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_requests)
    prompts = [[rng.randrange(low, vocab_size) for _ in range(n)] for n in in_lens]
    warmup = [rng.randrange(low, vocab_size) for _ in range(WARMUP_PROMPT_LEN)]
    return Workload(prompts, out_lens, warmup)


def arrival_times(cfg: LoadConfig) -> list[float]:
    """Send time of each request, seconds from the start."""
    if math.isinf(cfg.request_rate):
        return [0.0] * cfg.num_requests
    rng = random.Random(cfg.seed + 1)
    times, t = [], 0.0
    for _ in range(cfg.num_requests):
        times.append(t)
        t += (
            rng.expovariate(cfg.request_rate) if cfg.arrivals == "poisson" else 1 / cfg.request_rate
        )
    return times


def exact_request(prompt: list[int], output_len: int) -> gen_pb.GenerateRequest:
    """A request for exactly `output_len` greedy tokens (ignore_eos) after token-id `prompt`."""
    sampling = gen_pb.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    return gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=sampling)


async def one_request(
    stub: generation_pb2_grpc.GenerationStub, prompt: list[int], output_len: int
) -> RequestRecord:
    record = RequestRecord(len(prompt), output_len)
    request = exact_request(prompt, output_len)
    start = time.perf_counter()
    last: float | None = None
    try:
        async for r in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            now = time.perf_counter() - start
            if r.token_ids:
                record.on_message(now, len(r.token_ids), last)
                last = now
            if r.finish_reason:
                record.finish_reason = FINISH_FROM_PB[r.finish_reason] or ""
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    record.latency_s = time.perf_counter() - start
    return record


async def run_load(
    target: str, work: Workload, cfg: LoadConfig, progress: bool
) -> tuple[list[RequestRecord], float]:
    """All requests on their schedule; returns the records and the wall time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()
    times = arrival_times(cfg)
    async with channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        # One untimed request first (as vLLM's benchmark does): a fresh mesh's first request
        # pays one-time costs (connections, allocations) that are not serving performance.
        warm = await one_request(stub, work.warmup_prompt, WARMUP_TOKENS)
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
        )
        with bar:
            task = bar.add_task("requests", total=len(work.prompts))
            start = time.perf_counter()

            async def send(i: int) -> RequestRecord:
                await asyncio.sleep(max(0.0, times[i] - (time.perf_counter() - start)))
                async with limit:
                    rec = await one_request(stub, work.prompts[i], work.output_lens[i])
                bar.advance(task)
                return rec

            records = await asyncio.gather(*(send(i) for i in range(len(work.prompts))))
            duration = time.perf_counter() - start
    return list(records), duration


async def model_info(target: str) -> gen_pb.ModelInfo:
    async with channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return await stub.GetModelInfo(gen_pb.ModelInfoRequest(), timeout=30)


def offline_peer(engine: dict[str, Any], work: Workload) -> dict[str, float]:
    """The same requests on the offline engine, all submitted at once."""
    from pdmesh import LLM
    from pdmesh.bench.gpu_workloads import timed_generate

    llm = LLM(**engine)
    timed_generate(llm, [work.warmup_prompt], [WARMUP_TOKENS])
    seconds, produced, outputs = timed_generate(llm, work.prompts, work.output_lens)
    return {
        "duration_s": round(seconds, 3),
        "request_throughput": round(len(outputs) / seconds, 3),
        "output_throughput": round(produced / seconds, 2),
    }


def run_offline_peer(args: argparse.Namespace, work: Workload) -> dict[str, float]:
    """offline_peer in a fresh process: this one's gRPC threads measurably slowed the engine."""
    import multiprocessing

    engine = {
        "model": args.model,
        "kv_cache_tokens": args.kv_cache_tokens or 32768,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(offline_peer, (engine, work))


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pdmesh serving benchmark")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput"):
        table.add_row(key, str(summary[key]))
    if "goodput" in summary:
        table.add_row("goodput (req/s)", str(summary["goodput"]))
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        table.add_row(name, "  ".join(f"{k} {v:.1f}" for k, v in summary[name].items()))
    if peer := summary.get("offline_peer"):
        table.add_row("offline engine output_throughput", str(peer["output_throughput"]))
    Console(stderr=False).print(table)
    for e in summary.get("errors", []):
        print(f"error: {e}", file=sys.stderr)


def run_serving_bench(args: argparse.Namespace) -> int:
    cfg = from_args(LoadConfig, args, output_len=args.output_len or 128)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        info = asyncio.run(model_info(args.target))
    except grpc.RpcError as e:
        print(f"pdmesh bench: cannot reach a router at {args.target}: {e}", file=sys.stderr)
        return 1
    work = make_workload(cfg, info.vocab_size)
    try:
        records, duration = asyncio.run(run_load(args.target, work, cfg, not args.no_progress))
    except RuntimeError as e:
        print(f"pdmesh bench: {e}", file=sys.stderr)
        return 1
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device_name(),
        "cpu_count": os.cpu_count(),
        "target": args.target,
        "model": info.name,
        **{k: v for k, v in asdict(cfg).items() if k != "seed"},
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        **summarize(records, duration, slo),
    }
    if args.peer_offline:
        summary["offline_peer"] = run_offline_peer(args, work)
    print_summary(summary)
    write_json_out(args.json_out, summary)
    if args.plot:
        from pdmesh.bench.latency_plot import plot_cdfs

        if not plot_cdfs(records, args.plot):
            print(
                "pdmesh bench: --plot needs matplotlib (pip install matplotlib); no plot written.",
                file=sys.stderr,
            )
    return 0 if summary["failed"] == 0 else 1
