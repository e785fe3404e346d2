"""Live migration on the CPU: how long streams stall when their decode worker is drained, and the
KV bytes moved per request, against today's failover (the worker killed: its requests are
recomputed on the other one) measured in the same run.

`python -m pdmesh.bench.migration_cpu [--streams 8] [--prompt-len 256] [--max-tokens 256]
[--model PATH]` (default: the embedded default model). Each mode runs its own mesh of processes:
a router and two decode workers (no prefill pool). The streams start on the first worker alone
(the second is stopped with SIGSTOP, out of the rotation, then resumed); once every stream has
`--move-after` tokens, the first worker is drained (`Drain`) or killed (SIGKILL). A stream's
stall is the longest gap between its chunks from that moment on (its median inter-token gap
before is printed beside it); "every stream continuing" is when the last stream's stall ended.
Greedy, ignore-EOS: both modes' outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from pdmesh.bench.local_mesh import Chunks, Proc, decode_workers_ready, record_stream, until
from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.supervisor import stop
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc


def run_mode(mode: str, args: argparse.Namespace, prompts: list[list[int]], logs: Path) -> dict:
    engine = ["--model", args.model, "--kv-cache-tokens", str(args.kv_cache_tokens)]
    source = Proc("decode", engine, logs / f"{mode}-source.log")
    target = Proc("decode", engine, logs / f"{mode}-target.log")
    decode = f"{source.address},{target.address}"
    router = Proc(
        "router",
        ["--http-port", "0", "--decode", decode, "--model", args.model],
        logs / f"{mode}-router.log",
    )
    procs = [source, target, router]
    try:
        for p in procs:
            until(f"{p.address} serving", p.serving)
        until("both decode workers", lambda: decode_workers_ready(router.address) == 2)
        target.signal(signal.SIGSTOP)  # every stream starts on the source
        until("the target out", lambda: decode_workers_ready(router.address) == 1)
        result = asyncio.run(_streams(mode, args, prompts, router, source, target))
        stats = target.stats()
        result["target"] = {
            "migrations_in": stats.migrations_in,
            "migration_fallbacks": stats.migration_fallbacks,
            "migration_bytes_received": stats.migration_bytes_received,
            "local_prefills": stats.local_prefills,
            "kv_blocks_used_after": stats.kv_blocks_used,
            "block_size": stats.block_size,
        }
        return result
    finally:
        target.signal(signal.SIGCONT)
        for p in procs:
            stop(p.proc, 15)


async def _streams(
    mode: str,
    args: argparse.Namespace,
    prompts: list[list[int]],
    router: Proc,
    source: Proc,
    target: Proc,
) -> dict[str, Any]:
    chunks: list[Chunks] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        tasks = [
            asyncio.create_task(record_stream(stub, p, args.max_tokens, chunks[i], tokens[i]))
            for i, p in enumerate(prompts)
        ]
        while min(len(t) for t in tokens) < args.move_after // 2:
            await asyncio.sleep(0.005)
        target.signal(signal.SIGCONT)
        await asyncio.to_thread(
            until, "the target back", lambda: decode_workers_ready(router.address) == 2
        )
        while min(len(t) for t in tokens) < args.move_after:
            await asyncio.sleep(0.005)
        if any(len(t) >= args.max_tokens for t in tokens):
            raise RuntimeError("a stream ended before the move: raise --max-tokens")
        sent_at_move = [len(t) for t in tokens]
        t0 = time.monotonic()
        drain_s = None
        if mode == "migrate":
            with grpc.insecure_channel(source.address) as sch:
                stub_d = worker_pb2_grpc.DecodeWorkerStub(sch)
                reply = await asyncio.to_thread(
                    stub_d.Drain, worker_pb2.DrainRequest(), timeout=300
                )
            drain_s = time.monotonic() - t0
            moved = {"migrated": reply.migrated, "recomputed": reply.recomputed}
        else:
            source.signal(signal.SIGKILL)
            moved = {}
        await asyncio.gather(*tasks)
    stalls, continued, itl = [], [], []
    for times in chunks:
        before = [t for t, _ in times if t < t0]
        itl += [b - a for a, b in itertools.pairwise(before)]
        after = [t0] + [t for t, _ in times if t >= t0]
        gaps = [(b - a, b) for a, b in itertools.pairwise(after)]
        gap, end = max(gaps)
        stalls.append(gap)
        continued.append(end - t0)
    return {
        "mode": mode,
        "tokens": tokens,
        "tokens_at_move": sent_at_move,
        "drain_rpc_s": drain_s,
        "moved": moved,
        "every_stream_continuing_s": max(continued),
        "stall_s": {"median": statistics.median(stalls), "max": max(stalls)},
        "median_chunk_gap_before_s": statistics.median(itl) if itl else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder or .gguf; default: embedded")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--move-after", type=int, default=64, help="tokens each stream has first")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    args.model = str(resolve_model_folder(args.model))
    from pdmesh.engine.models.info import ModelInfo

    info = ModelInfo.load(Path(args.model))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, info.vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.streams)
    ]
    logs = Path(tempfile.mkdtemp(prefix="pdmesh-migration-bench-"))
    results = {m: run_mode(m, args, prompts, logs) for m in ("migrate", "failover")}
    mig, fo = results["migrate"], results["failover"]
    same = sum(a == b for a, b in zip(mig["tokens"], fo["tokens"], strict=True))
    t = mig["target"]
    per_request = t["migration_bytes_received"] / max(1, t["migrations_in"])
    # The KV of the tokens handed over (float32 on the CPU), in whole blocks.
    bs = t["block_size"]
    per_token = info.kv_block_bytes(1, 4)
    blocks = [-(-(args.prompt_len + n - 1) // bs) for n in mig["tokens_at_move"]]
    expected = statistics.mean(b * bs * per_token for b in blocks)
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "args": {k: v for k, v in vars(args).items() if k != "json_out"},
        "identical_outputs": f"{same}/{len(prompts)}",
        "kv_bytes_per_request": per_request,
        "kv_bytes_per_request_expected": expected,
        **{m: {k: v for k, v in r.items() if k != "tokens"} for m, r in results.items()},
    }
    print(json.dumps(summary, indent=2))
    for m, r in results.items():
        print(
            f"{m:9s} every stream continuing after {r['every_stream_continuing_s'] * 1e3:7.0f} ms;"
            f" stall median {r['stall_s']['median'] * 1e3:6.0f} ms, max"
            f" {r['stall_s']['max'] * 1e3:6.0f} ms (chunk gap before: "
            f"{(r['median_chunk_gap_before_s'] or 0) * 1e3:.0f} ms)"
        )
    print(
        f"KV moved per request: {per_request / 2**20:.2f} MiB (its blocks: "
        f"{expected / 2**20:.2f} MiB); outputs identical {same}/{len(prompts)}"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
