"""The `pdmesh` subcommands but `bench` (bench/command.py) and `healthcheck`
(pdmesh/healthcheck.py): their flags and what they run."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pdmesh.flags import (
    engine_args,
    engine_options,
    from_args,
    planner_args,
    planner_config,
    sampling_args,
    tls_args,
    tls_config,
)
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
    u = _service(sub, "up", "start a router and its workers as local processes", 50051, cmd_up)
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
    _front_args(u)
    _reliability_args(u)
    u.add_argument(
        "--ask",
        default="What is the capital of France?",
        help="ask this once everything is up (empty: don't)",
    )
    engine_args(u)


def cmd_up(args: argparse.Namespace) -> int:
    from pdmesh.mesh import run_up

    exit_service(run_up(args))


# -- services ---------------------------------------------------------------------------------
def _service(sub: Any, name: str, help: str, port: int, func: Any) -> argparse.ArgumentParser:
    """A service's subcommand: where it listens, TLS, and the function that runs it."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    tls_args(p)
    p.set_defaults(func=func)
    return p


def _worker(
    sub: Any, name: str, port: int, func: Any, help: str | None = None
) -> argparse.ArgumentParser:
    p = _service(sub, name, help or f"run a {name} worker", port, func)
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


def add_services(sub: Any) -> None:
    r = _service(sub, "router", "run the router (gRPC API + HTTP gateway)", 50051, cmd_router)
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
    _front_args(r)

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
    _kvstore_args(_service(sub, "kvstore", "run a KV store the workers share", 50081, cmd_kvstore))


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
    _reliability_args(d)


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


def _reliability_args(p: argparse.ArgumentParser) -> None:
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


def _front_args(p: argparse.ArgumentParser) -> None:
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
    _api_key_args(p)


def _api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-keys", default=None, help="comma-separated keys the public API requires")
    p.add_argument("--api-keys-file", default=None, help="a file of API keys, one per line")
    p.add_argument(
        "--public-client-auth",
        action="store_true",
        help="clients of the public API must present a certificate signed by --tls-ca",
    )


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
