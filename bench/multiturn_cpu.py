"""Multi-turn chat through the mesh, with and without the KV tiers: TTFT p50 / p99.

`python -m pdmesh.bench.multiturn_cpu [--sessions 7] [--turns 4] [--json-out F]`, on the default
model (CPU). Sessions share a system prompt; each turn sends the session's whole history (system
prompt, earlier user messages and the replies the mesh gave) plus a new user message, and the
reply is appended to the history. Turns go round the sessions one request at a time (turn 0 of
every session, then turn 1, ...), so a session's history is long evicted from a worker's small
device cache (`--kv-cache-tokens`) by the time its next turn comes. Two decode workers take the
requests in turn (round robin, an odd number of sessions): a session's consecutive turns land on
different workers, the case a per-worker cache cannot serve.

Three meshes, one after the other, same requests: no tiers; the host tier on each worker
(`--kv-offload-gib`); the host tier and a KV store shared by both (`--kvstore`). TTFT is the
client's time from sending a request to its first token. Prompts are token ids from a fixed
seed (the figures depend on lengths, not words); greedy replies are checked to be identical
across the three meshes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import time
from typing import Any

import grpc
import numpy as np

from pdmesh.bench.serving import exact_request
from pdmesh.mesh import quiet_up, read_services
from pdmesh.processes import free_port
from pdmesh.supervisor import stop
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

VOCAB = 49_000  # below SmolLM2's 49,152


def _turns(sessions: int, turns: int, system: int, user: int, seed: int) -> list[list[list[int]]]:
    """[session][turn] -> the new user message's token ids; [session][0] starts with the shared
    system prompt."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(system)]
    out = []
    for _ in range(sessions):
        msgs = [[rng.randrange(VOCAB) for _ in range(user)] for _ in range(turns)]
        msgs[0] = shared + msgs[0]
        out.append(msgs)
    return out


async def _ask(stub: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the reply's tokens)."""
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    async for r in stub.Generate(exact_request(prompt, max_tokens), timeout=300):
        if r.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += r.token_ids
    assert first is not None, "no token came"
    return first, tokens


def _worker_stats(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as ch:
        s = worker_pb2_grpc.DecodeWorkerStub(ch).GetStats(worker_pb2.StatsRequest(), timeout=10)
    keys = ("prefix_hit_tokens", "prefix_queried_tokens", "host_tier_hit_tokens")
    keys += ("store_hit_tokens", "store_published_blocks", "store_fetch_failures")
    return {k: getattr(s, k) for k in keys}


def run_mesh(name: str, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDMESH_LOG_LEVEL": "WARNING"}
    argv = ["--prefill", "0", "--decode", "2", "--policy", "round_robin"]
    argv += ["--kv-cache-tokens", str(args.kv_cache_tokens), *flags]
    proc = subprocess.Popen(
        quiet_up(port, *argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    output: list[str] = []
    try:
        services = read_services(proc.stdout, output.append)
    except RuntimeError:
        stop(proc, 30)
        raise RuntimeError(f"{name}: pdmesh up exited:\n" + "".join(output[-30:])) from None
    decode = [s.address for s in services if s.role == "decode"]
    msgs = _turns(args.sessions, args.turns, args.system_tokens, args.user_tokens, args.seed)

    async def drive() -> tuple[list[tuple[int, float]], list[list[int]]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            await _ask(stub, [1, 2, 3, 4], 2)  # untimed: a fresh mesh's one-time costs
            history: list[list[int]] = [[] for _ in range(args.sessions)]
            ttft: list[tuple[int, float]] = []
            for t in range(args.turns):
                for s in range(args.sessions):
                    prompt = history[s] + msgs[s][t]
                    first, reply = await _ask(stub, prompt, args.reply_tokens)
                    ttft.append((t, first))
                    history[s] = prompt + reply
            return ttft, history

    try:
        started = time.perf_counter()
        ttft, history = asyncio.run(drive())
        wall = time.perf_counter() - started
        stats = [_worker_stats(d) for d in decode]
    finally:
        stop(proc, 30)
    later = [x for t, x in ttft if t > 0]
    return {
        "mesh": name,
        "flags": flags,
        "ttft_p50_ms": float(np.percentile([x for _, x in ttft], 50) * 1000),
        "ttft_p99_ms": float(np.percentile([x for _, x in ttft], 99) * 1000),
        "later_turns_ttft_p50_ms": float(np.percentile(later, 50) * 1000),
        "later_turns_ttft_p99_ms": float(np.percentile(later, 99) * 1000),
        "requests": len(ttft),
        "longest_prompt": max(len(h) for h in history) - args.reply_tokens,
        "wall_s": wall,
        "workers": stats,
        "histories": history,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=7, help="odd: consecutive turns change worker")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, default=1024, help="each worker's device cache")
    p.add_argument("--kv-offload-gib", type=float, default=0.5, help="each worker's host tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    tier = ["--kv-offload-gib", str(args.kv_offload_gib)]
    meshes = [("no tiers", []), ("host tier", tier), ("host tier + KV store", [*tier, "--kvstore"])]
    results = [run_mesh(name, flags, args) for name, flags in meshes]
    same = all(r["histories"] == results[0]["histories"] for r in results)
    base = results[0]["ttft_p50_ms"]
    print(f"{'mesh':24} {'TTFT p50':>9} {'p99':>9} {'later p50':>10} {'p99':>9} {'vs none':>8}")
    for r in results:
        print(
            f"{r['mesh']:24} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
            f"{r['later_turns_ttft_p50_ms']:10.1f} {r['later_turns_ttft_p99_ms']:9.1f} "
            f"{base / r['ttft_p50_ms']:7.2f}x"
        )
        print(f"{'':24} workers: {r['workers']}")
    print(f"replies identical across the meshes: {same}")
    if args.json_out:
        report = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "args": vars(args),
            "replies_identical": same,
            "results": [{k: v for k, v in r.items() if k != "histories"} for r in results],
        }
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
