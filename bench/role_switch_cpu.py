"""A role switch under load on the CPU (issue 33): a decode worker holding running streams is
switched to prefill by hand (the router's SetWorkerRole, what `pdmesh role` calls). How long the
switch takes from the command to the worker serving its new role, and what the streams it held
see (moved to the other decode worker with their KV) against streams that were not moved.

`python -m pdmesh.bench.role_switch_cpu [--streams 8] [--prompt-len 256] [--max-tokens 256]
[--switch-after 64] [--model PATH] [--json-out FILE]` (default: the embedded default model).

A mesh of processes: a router and three workers of either role (`pdmesh worker --role`): `a`
and `b` decode, `p` prefill. `b` is stopped (SIGSTOP, out of the rotation) while `--streams`
streams start, so they all land on `a`; `b` is resumed and as many streams again start, landing
on `b` (the router sends decode to the least loaded). Once every stream has `--switch-after`
tokens, `a` is switched to prefill. Per group: each stream's longest gap from the command on
(its stall), and the p50 / p99 inter-token latency before and after it (a chunk's gap shared by
its tokens). Greedy, ignore-EOS; every stream must get all its tokens.
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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _token_gaps(chunks: Chunks, lo: float, hi: float) -> list[float]:
    """Inter-token latency of the tokens that arrived in [lo, hi): a chunk's gap from the one
    before, shared by its tokens."""
    gaps = []
    for (a, _), (b, n) in itertools.pairwise(chunks):
        if lo <= b < hi and n:
            gaps += [(b - a) / n] * n
    return gaps


def _group(streams: list[Chunks], t0: float) -> dict[str, Any]:
    before = [g for c in streams for g in _token_gaps(c, 0.0, t0)]
    after = [g for c in streams for g in _token_gaps(c, t0, float("inf"))]
    stalls = []
    for chunks in streams:
        times = [t0] + [t for t, _ in chunks if t >= t0]
        stalls.append(max((b - a for a, b in itertools.pairwise(times)), default=0.0))

    def ms(values: list[float], q: float) -> float:
        return _percentile(values, q) * 1e3

    return {
        "itl_before_ms": {"p50": ms(before, 0.5), "p99": ms(before, 0.99)},
        "itl_after_ms": {"p50": ms(after, 0.5), "p99": ms(after, 0.99)},
        "stall_ms": {"median": statistics.median(stalls) * 1e3, "max": max(stalls) * 1e3},
    }


async def _run(args: argparse.Namespace, prompts: list[list[int]], mesh: dict[str, Proc]) -> dict:
    router, a, b = mesh["router"], mesh["a"], mesh["b"]
    chunks: list[Chunks] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    n = args.streams
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        def one(i: int) -> asyncio.Task[None]:
            return asyncio.create_task(
                record_stream(stub, prompts[i], args.max_tokens, chunks[i], tokens[i])
            )

        moved = [one(i) for i in range(n)]  # on `a`: `b` is stopped
        while min(len(t) for t in tokens[:n]) < 4:
            await asyncio.sleep(0.005)
        b.signal(signal.SIGCONT)
        await asyncio.to_thread(
            until, "b back in rotation", lambda: decode_workers_ready(router.address) == 2
        )
        kept = [one(i) for i in range(n, 2 * n)]  # on `b`, the least loaded
        while min(len(t) for t in tokens) < args.switch_after:
            await asyncio.sleep(0.005)
        if max(len(t) for t in tokens) >= args.max_tokens:
            raise RuntimeError("a stream ended before the switch: raise --max-tokens")
        t0 = time.monotonic()
        with grpc.insecure_channel(router.address) as sch:
            request = worker_pb2.SetWorkerRoleRequest(worker=a.address, role="prefill")
            reply = await asyncio.to_thread(
                worker_pb2_grpc.MeshControlStub(sch).SetWorkerRole, request, timeout=600
            )
        switch_s = time.monotonic() - t0
        await asyncio.gather(*moved, *kept)
    if any(len(t) != args.max_tokens for t in tokens):
        raise RuntimeError(f"a stream lost or repeated tokens: {[len(t) for t in tokens]}")
    return {
        "switch_s": switch_s,
        "migrated": reply.migrated,
        "recomputed": reply.recomputed,
        "moved_streams": _group(chunks[:n], t0),
        "undisturbed_streams": _group(chunks[n:], t0),
        "a_after": {"role": a.stats().role, "kv_blocks_used": a.stats().kv_blocks_used},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder or .gguf; default: embedded")
    p.add_argument("--streams", type=int, default=8, help="streams moved, and as many kept")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--switch-after", type=int, default=64, help="tokens each stream has first")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    args.model = str(resolve_model_folder(args.model))
    from pdmesh.engine.models.info import ModelInfo

    vocab = ModelInfo.load(Path(args.model)).vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(2 * args.streams)
    ]
    logs = Path(tempfile.mkdtemp(prefix="pdmesh-role-switch-bench-"))
    engine = ["--model", args.model, "--kv-cache-tokens", str(args.kv_cache_tokens)]
    mesh = {
        name: Proc("worker", [*engine, "--role", role], logs / f"{name}.log")
        for name, role in (("a", "decode"), ("b", "decode"), ("p", "prefill"))
    }
    decode = f"{mesh['a'].address},{mesh['b'].address}"
    mesh["router"] = Proc(
        "router",
        ["--http-port", "0", "--decode", decode, "--prefill", mesh["p"].address,
         "--model", args.model, "--disagg-min-tokens", "16"],
        logs / "router.log",
    )  # fmt: skip
    try:
        for proc in mesh.values():
            until(f"{proc.address} serving", proc.serving)
        until("both decode workers", lambda: decode_workers_ready(mesh["router"].address) == 2)
        mesh["b"].signal(signal.SIGSTOP)  # the first streams start on `a`
        until("b out", lambda: decode_workers_ready(mesh["router"].address) == 1)
        result = asyncio.run(_run(args, prompts, mesh))
    finally:
        mesh["b"].signal(signal.SIGCONT)
        for proc in mesh.values():
            stop(proc.proc, 15)
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "args": {k: v for k, v in vars(args).items() if k != "json_out"},
        **result,
    }
    print(json.dumps(summary, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
