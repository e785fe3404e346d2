"""`pdmesh generate` (one prompt, offline or from a router) and `pdmesh up` (a router and its
workers as local processes)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pdmesh.commands.args import front_args, reliability_args, service
from pdmesh.flags import engine_args, engine_options, sampling_args, tls_args
from pdmesh.processes import exit_service


# -- generate ---------------------------------------------------------------------------------
def add_generate(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt (offline or from a router)")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--offline", action="store_true", help="run the engine in this process")
    mode.add_argument("--target", help="stream from a router at HOST:PORT")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--json", action="store_true", help="print JSON with token ids")
    g.add_argument("--api-key", default=None, help="the router's API key (PDMESH_API_KEY)")
    sampling_args(g)
    engine_args(g)
    tls_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.target:
        from pdmesh.client import stream_generate

        return asyncio.run(stream_generate(args))
    from pdmesh import LLM
    from pdmesh.client import request_from_args
    from pdmesh.serving.convert import sampling_from_pb

    llm = LLM(**engine_options(args))
    params = sampling_from_pb(request_from_args(args).sampling)  # as a router would take them
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    done = out.outputs[0]
    ids = {"token_ids": done.token_ids, "prompt_token_ids": out.prompt_token_ids}
    body = {"text": done.text, **ids, "finish_reason": done.finish_reason}
    print(json.dumps(body) if args.json else done.text)
    return 0


# -- up ---------------------------------------------------------------------------------------
def add_up(sub: Any) -> None:
    u = service(sub, "up", "start a router and its workers as local processes", 50051, cmd_up)
    u.add_argument("--prefill", type=int, default=1, help="prefill workers")
    u.add_argument("--decode", type=int, default=1, help="decode workers")
    u.add_argument(
        "--kv-transport",
        default="auto",
        help="KV data plane: auto (per pair: nccl between different GPUs, else tcp) | tcp | "
        "nccl (GPUs) | gloo (CPUs)",
    )
    for role in ("prefill", "decode"):
        help = f"tensor-parallel size of each {role} worker (default: --tensor-parallel-size)"
        u.add_argument(f"--{role}-tp", type=int, default=None, help=help)
        help = f"pipeline stages of each {role} worker (default: --pipeline-parallel-size)"
        u.add_argument(f"--{role}-pp", type=int, default=None, help=help)
        help = (
            f"data-parallel ranks of each {role} worker, each a worker of its own to the router "
            "(default: --data-parallel-size)"
        )
        u.add_argument(f"--{role}-dp", type=int, default=None, help=help)
    u.add_argument(
        "--kvstore",
        action="store_true",
        help="start a KV store too (`pdmesh kvstore`), which every worker and the router use",
    )
    u.add_argument("--kvstore-capacity-gib", type=float, default=2.0, help="its --capacity-gib")
    u.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill pool: decode workers do both phases (the baseline)",
    )
    u.add_argument("--ready-timeout", type=float, default=600.0)
    front_args(u)
    reliability_args(u)
    u.add_argument(
        "--ask",
        default="What is the capital of France?",
        help="ask this once everything is up (empty: don't)",
    )
    engine_args(u)


def cmd_up(args: argparse.Namespace) -> int:
    from pdmesh.mesh import run_up

    exit_service(run_up(args))
