"""`pdmesh bench`: its flags, and which benchmark they run (see BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from pdmesh.flags import engine_args


def add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)")
    mode = b.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--offline", action="store_true", help="the engine in this process vs transformers"
    )
    mode.add_argument("--target", help="a serving benchmark against a router at HOST:PORT")
    mode.add_argument(
        "--relay", action="store_true", help="the router's relay capacity, fed by token sources"
    )
    mode.add_argument(
        "--soak",
        action="store_true",
        help="mixed load with cancellations on a mesh of its own: leaks and memory growth",
    )
    mode.add_argument(
        "--fuzz",
        action="store_true",
        help="hostile requests on both edges of a mesh: no 5xx, hang or worker death allowed",
    )
    mode.add_argument(
        "--serve",
        action="store_true",
        help="pdmesh up against vllm serve, both driven by vllm bench serve (bench/serve_peer.py)",
    )
    mode.add_argument(
        "--speculative",
        action="store_true",
        help="n-gram speculative decoding against none, CPU, default model (bench/speculative.py)",
    )
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--json-out", default=None, help="write the figures as JSON here")
    b.add_argument("--skip-peer", action="store_true", help="do not run the peer")
    b.add_argument(
        "--peer",
        choices=("transformers", "vllm"),
        default="transformers",
        help="--offline, --speculative: the peer engine (vllm: vLLM's CPU build, in a venv of "
        "its own; --speculative runs it with and without n-gram speculation)",
    )
    b.add_argument(
        "--peer-cores",
        choices=("all", "default"),
        default="all",
        help="--peer vllm, --serve: vLLM's engine on every core, as pdmesh's (all), or on "
        "vLLM's default, which keeps one core for its frontend (on 2 cores: one for its engine)",
    )
    b.add_argument(
        "--peer-venv",
        default="~/.cache/pdmesh/vllm-cpu-venv",
        help="--peer vllm: the venv holding vLLM (made when missing)",
    )

    s = b.add_argument_group("serving (--target)")
    s.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once"
    )
    s.add_argument(
        "--arrivals", default="poisson", choices=("poisson", "constant"), help="inter-arrival times"
    )
    s.add_argument("--concurrency", type=int, default=None, help="at most this many in flight")
    s.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    s.add_argument(
        "--output-len", type=int, default=None, help="mean output tokens (128; relay 512)"
    )
    s.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1-r, 1+r]"
    )
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    s.add_argument("--plot", default=None, help="write latency CDFs to this PNG (matplotlib)")
    s.add_argument(
        "--peer-offline",
        action="store_true",
        help="also run the same requests on the offline engine (a fresh local process)",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = b.add_argument_group("relay (--relay)")
    r.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    r.add_argument("--sources", type=int, default=2, help="token-source processes")
    r.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    r.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    r.add_argument("--step-ms", type=float, default=1.0, help="token-source step interval")
    r.add_argument(
        "--colocated",
        action="store_true",
        help="tokens from a decode worker on the model (pdmesh up --colocated), not sources",
    )
    r.add_argument(
        "--http", action="store_true", help="clients stream SSE from the gateway, not gRPC"
    )
    k = b.add_argument_group("soak (--soak; --duration sets its length, e.g. 600)")
    k.add_argument("--kv-target", type=float, default=0.8, help="share of KV capacity in use")
    k.add_argument("--cancel-fraction", type=float, default=0.2, help="requests the client cancels")
    v = b.add_argument_group("speculative decoding (--speculative)")
    v.add_argument("--max-tokens", type=int, default=160, help="output tokens per request, most")
    v.add_argument(
        "--sweep", type=int, nargs="*", default=[], help="batch sizes to find the threshold at"
    )
    v.add_argument(
        "--draft-model", default=None, help="also a draft model at batch 1 (default: itself)"
    )
    e = b.add_argument_group("against vllm serve (--serve; --num-requests, --input-len, ...)")
    e.add_argument("--rounds", type=int, default=1, help="vllm, then pdmesh, this many times")
    e.add_argument(
        "--client",
        choices=("vllm", "aiperf"),
        default="vllm",
        help="the client driving both servers: vllm bench serve, or NVIDIA's AIPerf",
    )
    e.add_argument(
        "--aiperf-venv",
        default="~/.cache/pdmesh/aiperf-venv",
        help="--client aiperf: the venv holding AIPerf (made when missing)",
    )
    e.add_argument(
        "--disagg", action="store_true", help="pdmesh up --prefill 1 --decode 1, not --colocated"
    )
    f = b.add_argument_group("fuzz (--fuzz)")
    f.add_argument("--fuzz-cases", type=int, default=3000, help="hostile requests to send")
    f.add_argument(
        "--fuzz-target", default=None, help="a running router's gRPC HOST:PORT (default: own mesh)"
    )
    f.add_argument(
        "--fuzz-http", default=None, help="its HTTP gateway, http://HOST:PORT (with --fuzz-target)"
    )
    engine_args(b)
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the mode flag picks: bench/<mode>.py's run_<mode>_bench(args)."""
    mode = (
        "serving" if args.target else "relay" if args.relay else "soak" if args.soak else "offline"
    )
    mode = "speculative" if args.speculative else "fuzz" if args.fuzz else mode
    mode = "serve_peer" if args.serve else mode
    return getattr(importlib.import_module(f"pdmesh.bench.{mode}"), f"run_{mode}_bench")(args)
