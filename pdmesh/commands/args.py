"""The parser of a service's subcommand and the flag groups several subcommands share (`pdmesh
up` passes the router's and the decode workers' through to them)."""

from __future__ import annotations

import argparse
from typing import Any

from pdmesh.flags import planner_args, tls_args


def service(sub: Any, name: str, help: str, port: int, func: Any) -> argparse.ArgumentParser:
    """A service's subcommand: where it listens, TLS, and the function that runs it."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    tls_args(p)
    p.set_defaults(func=func)
    return p


def reliability_args(p: argparse.ArgumentParser) -> None:
    """Decode-worker limits that `pdmesh up` passes through."""
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests waiting for KV blocks beyond this are refused (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        default=300.0,
        help="seconds a remote prefill and its KV push may take before the failure policy",
    )


def front_args(p: argparse.ArgumentParser) -> None:
    """The router's public side and dispatch, which `pdmesh up` passes through."""
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP; 0: off")
    p.add_argument("--policy", default="kv", help="kv | round_robin")
    p.add_argument("--disagg-min-tokens", type=int, default=64)
    planner_args(p)
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="the model's tool-call format for tool_choice auto: hermes (Hermes, Qwen2.5, "
        "Qwen3) | llama3_json (Llama 3.1+); default: the one its chat template asks for",
    )
    api_key_args(p)


def api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-keys", default=None, help="comma-separated keys the public API requires")
    p.add_argument("--api-keys-file", default=None, help="a file of API keys, one per line")
    p.add_argument(
        "--public-client-auth",
        action="store_true",
        help="clients of the public API must present a certificate signed by --tls-ca",
    )
