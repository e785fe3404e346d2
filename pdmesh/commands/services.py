"""`pdmesh router` and `pdmesh kvstore`, and the registration of every service's subcommand (the
workers' are in workers.py)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pdmesh.commands.args import front_args, service
from pdmesh.commands.workers import add_workers
from pdmesh.flags import from_args, planner_config, tls_config
from pdmesh.processes import exit_service


def add_services(sub: Any) -> None:
    """`pdmesh router`, the workers' subcommands (workers.py), then `pdmesh kvstore`."""
    r = service(sub, "router", "run the router (gRPC API + HTTP gateway)", 50051, cmd_router)
    r.add_argument("--prefill", default="", help="prefill workers: HOST:PORT,HOST:PORT")
    r.add_argument("--decode", default="", help="decode workers: HOST:PORT,HOST:PORT")
    r.add_argument("--overlap-weight", type=float, default=1.0)
    r.add_argument("--served-model-name", default=None)
    r.add_argument("--model", default=None, help="for the tokenizer and model info")
    r.add_argument("--max-model-len", type=int, default=None)
    r.add_argument(
        "--kvstore",
        default=None,
        metavar="HOST:PORT",
        help="a KV store: the kv policy counts the prefix blocks it holds as cheaper than a miss",
    )
    r.add_argument(
        "--max-failovers",
        type=int,
        default=2,
        help="times a request moves to another decode worker when its worker is lost",
    )
    front_args(r)
    add_workers(sub)  # decode, worker, prefill
    _kvstore_args(service(sub, "kvstore", "run a KV store the workers share", 50081, cmd_kvstore))


def _kvstore_args(s: argparse.ArgumentParser) -> None:
    """`pdmesh kvstore`: its data plane (named like a decode worker's too), budget, timeouts."""
    host, port, advertise = (("--data-" + n, "--kv-" + n) for n in ("host", "port", "advertise"))
    s.add_argument(
        *host, dest="kv_host", metavar="HOST", help="data plane bind host (default: --host)"
    )
    s.add_argument(
        *port,
        dest="kv_port",
        metavar="PORT",
        type=int,
        default=50082,
        help="data plane port workers push blocks to and get them from; 0: a free one",
    )
    s.add_argument(
        *advertise,
        dest="kv_advertise",
        metavar="HOST[:PORT]",
        help="HOST or HOST:PORT workers reach the data plane at (default: the bound address; "
        "needed with --host 0.0.0.0)",
    )
    s.add_argument(
        "--capacity-gib",
        type=float,
        default=4.0,
        help="GiB of KV blocks held in memory; beyond it the least recently used are evicted",
    )
    s.add_argument(
        "--put-timeout",
        type=float,
        default=30.0,
        help="seconds a worker's blocks may take to arrive before they are dropped",
    )
    s.add_argument(
        "--get-timeout", type=float, default=30.0, help="the longest a push to a worker may take"
    )
    s.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics; 0: off")
    s.add_argument("--api-keys", default=None, help="comma-separated keys every call needs")
    s.add_argument("--api-keys-file", default=None, help="a file of API keys, one per line")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def cmd_router(args: argparse.Namespace) -> int:
    from pdmesh.router.config import RouterConfig
    from pdmesh.router.server import serve
    from pdmesh.serving.auth import ApiKeys

    config = from_args(
        RouterConfig,
        args,
        prefill=_addresses(args.prefill),
        decode=_addresses(args.decode),
        bind=f"{args.host}:{args.port}",
        http_bind=f"{args.host}:{args.http_port}" if args.http_port else None,
        tls=tls_config(args),
        api_keys=ApiKeys.from_flags(args.api_keys, args.api_keys_file),
        planner=planner_config(args),
        slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_itl_p99_s=None if args.slo_itl_p99_ms is None else args.slo_itl_p99_ms / 1000,
    )
    asyncio.run(serve(config))
    exit_service(0)


def cmd_kvstore(args: argparse.Namespace) -> int:
    from pdmesh.kvstore_service.config import GIB, KVStoreConfig
    from pdmesh.kvstore_service.server import serve
    from pdmesh.serving.auth import ApiKeys

    config = KVStoreConfig(
        bind=f"{args.host}:{args.port}",
        data_bind=f"tcp://{args.kv_host or args.host}:{args.kv_port}",
        data_advertise=args.kv_advertise,
        capacity_bytes=int(args.capacity_gib * GIB),
        put_timeout_s=args.put_timeout,
        get_timeout_s=args.get_timeout,
        metrics_bind=f"{args.host}:{args.metrics_port}" if args.metrics_port else None,
        tls=tls_config(args),
        api_keys=ApiKeys.from_flags(args.api_keys, args.api_keys_file),
    )
    asyncio.run(serve(config))
    exit_service(0)
