"""The workers' subcommands: `pdmesh decode`, `pdmesh worker` (either role) and `pdmesh
prefill`, their flags and how each runs."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pdmesh.commands.args import reliability_args, service
from pdmesh.flags import engine_args, engine_options, from_args, tls_config
from pdmesh.processes import exit_service


def add_workers(sub: Any) -> None:
    """`pdmesh decode`, `pdmesh worker` and `pdmesh prefill`."""
    _decode_args(_worker(sub, "decode", 50061, cmd_decode))
    w = _worker(sub, "worker", 50061, cmd_worker, "run a worker that takes either role")
    _decode_args(w)
    w.add_argument(
        "--role",
        default="decode",
        help="prefill | decode: the role it starts in (`pdmesh role` switches it)",
    )
    w.add_argument("--kv-send-timeout", type=float, default=30.0, help="as a prefill worker's")

    p = _worker(sub, "prefill", 50071, cmd_prefill)
    p.add_argument("--kv-send-timeout", type=float, default=30.0)


def _worker(
    sub: Any, name: str, port: int, func: Any, help: str | None = None
) -> argparse.ArgumentParser:
    p = service(sub, name, help or f"run a {name} worker", port, func)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics; 0: off")
    p.add_argument(
        "--kvstore",
        default=None,
        metavar="HOST:PORT",
        help="a KV store (`pdmesh kvstore`): prompts read through it, computed blocks published",
    )
    p.add_argument("--kvstore-timeout", type=float, default=0.5, help="its lookups' limit (s)")
    p.add_argument(
        "--kvstore-fetch-timeout", type=float, default=5.0, help="its fetches' limit (s)"
    )
    p.add_argument(
        "--kvstore-advertise",
        default=None,
        metavar="HOST",
        help="the host the store pushes fetched blocks to (default: the bind host)",
    )
    p.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="with --data-parallel-size N: which of the worker's N ranks this process is",
    )
    p.add_argument(
        "--data-parallel-address",
        default=None,
        metavar="HOST:PORT",
        help="with --data-parallel-size N: where rank 0 listens for the other ranks",
    )
    engine_args(p)
    return p


def _store_options(args: argparse.Namespace, data_host: str) -> Any:
    """The worker's StoreOptions (--kvstore ...), or None without --kvstore."""
    if not args.kvstore:
        return None
    from pdmesh.serving.store_link import StoreOptions

    try:
        return StoreOptions(
            args.kvstore,
            args.kvstore_timeout,
            args.kvstore_fetch_timeout,
            data_host,
            args.kvstore_advertise,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _decode_args(d: argparse.ArgumentParser) -> None:
    """A decode worker's own flags (`pdmesh decode`, `pdmesh worker`)."""
    d.add_argument(
        "--kv-transport",
        default="auto",
        help="KV data plane of pairs not named by --kv-transport-for: tcp | nccl (GPUs) | gloo "
        "(CPUs) | auto (nccl for a GPU cache, else tcp)",
    )
    d.add_argument(
        "--kv-transport-for",
        action="append",
        default=[],
        metavar="PREFILL=TRANSPORT",
        help="the transport of the pair with one prefill worker (its host:port); repeatable",
    )
    d.add_argument("--kv-host", default=None, help="KV data plane bind host (default: --host)")
    d.add_argument("--kv-port", type=int, default=0)
    d.add_argument(
        "--kv-advertise",
        default=None,
        help="HOST or HOST:PORT prefill workers push KV to (default: the bound address)",
    )
    d.add_argument("--prefill-failure-policy", default="recompute", help="recompute | fail")
    d.add_argument("--kv-timeout", type=float, default=30.0)
    d.add_argument(
        "--drain-on-sigterm",
        action="store_true",
        help="on SIGTERM move running requests to other decode workers with their KV (live "
        "migration), then exit (the Kubernetes preStop hook's counterpart)",
    )
    reliability_args(d)


def _serve_worker(config_cls: Any, serve: Any, args: argparse.Namespace, **fields: Any) -> int:
    """Run a worker until it stops: its config made of the flags every worker has (engine, where
    it listens, its /metrics port, TLS) and its own `fields`."""
    from pdmesh.engine.config import EngineConfig

    engine = EngineConfig(**engine_options(args))
    if engine.node_rank > 0:  # another node of a static launch: its ranks only, no service
        from pdmesh.engine.executor.nodes import serve_node

        kv_host = getattr(args, "kv_host", None) or args.host
        return serve_node(engine, kv_host, getattr(args, "kv_advertise", None))
    metrics = f"{args.host}:{args.metrics_port}" if args.metrics_port else None
    config = from_args(
        config_cls,
        args,
        engine=engine,
        bind=f"{args.host}:{args.port}",
        metrics_bind=metrics,
        tls=tls_config(args),
        data_parallel=_data_parallel_rank(args),
        **fields,
    )
    asyncio.run(serve(config))
    exit_service(0)


def _data_parallel_rank(args: argparse.Namespace) -> Any:
    """The worker's DataParallelRank (--data-parallel-address given), else None."""
    if args.data_parallel_address is None:
        return None
    from pdmesh.serving.data_parallel import DataParallelRank

    return DataParallelRank(args.data_parallel_rank, args.data_parallel_address)


def cmd_decode(args: argparse.Namespace) -> int:
    from pdmesh.decode_service.config import DecodeConfig
    from pdmesh.decode_service.server import serve

    return _serve_worker(DecodeConfig, serve, args, **_decode_fields(args))


def cmd_worker(args: argparse.Namespace) -> int:
    from pdmesh.worker_service.config import WorkerConfig
    from pdmesh.worker_service.server import serve

    return _serve_worker(
        WorkerConfig,
        serve,
        args,
        role=args.role,
        kv_send_timeout_s=args.kv_send_timeout,
        **_decode_fields(args),
    )


def _decode_fields(args: argparse.Namespace) -> dict[str, Any]:
    """A decode worker's config fields from its own flags."""
    return {
        "kv_transport_for": _transport_for(args.kv_transport_for),
        "kv_bind": f"tcp://{args.kv_host or args.host}:{args.kv_port}",
        "kv_timeout_s": args.kv_timeout,
        "prefill_timeout_s": args.prefill_timeout,
        "kvstore": _store_options(args, args.kv_host or args.host),
        "drain_on_sigterm": args.drain_on_sigterm,
    }


def _transport_for(pairs: list[str]) -> dict[str, str]:
    """PREFILL=TRANSPORT flags as a mapping (SystemExit naming a malformed one)."""
    out: dict[str, str] = {}
    for pair in pairs:
        address, sep, transport = pair.rpartition("=")
        if not sep or not address or not transport:
            raise SystemExit(f"--kv-transport-for wants PREFILL_HOST:PORT=TRANSPORT, got {pair!r}")
        out[address] = transport
    return out


def cmd_prefill(args: argparse.Namespace) -> int:
    from pdmesh.prefill_service.config import PrefillConfig
    from pdmesh.prefill_service.server import serve

    return _serve_worker(
        PrefillConfig,
        serve,
        args,
        kv_send_timeout_s=args.kv_send_timeout,
        kvstore=_store_options(args, args.host),
    )
