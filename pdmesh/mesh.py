"""`pdmesh up`: which services a local mesh runs, on which ports and GPUs, with which flags.

`plan_mesh` turns `pdmesh up`'s flags into one `ProcessSpec` per service (a KV store when asked,
prefill workers, decode workers, then the router, each a `python -m pdmesh.cli` command on free
ports) without starting anything; `run_up` starts them under pdmesh/supervisor.py, waits until
the router has every worker in rotation (and the KV store serves), and restarts workers that
exit until Ctrl-C or SIGTERM. Engine and TLS flags go to every worker (TLS to the router and the
KV store too; each child uses the same certificate as server and client); API keys go to the
router through its environment, not its command line.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pdmesh import envs, healthcheck
from pdmesh.client import RouterClient
from pdmesh.flags import engine_argv, engine_options, planner_argv, planner_config, tls_argv
from pdmesh.processes import free_port
from pdmesh.serving.tls import TLSConfig
from pdmesh.supervisor import Child, ProcessSpec, spawn, stop_all, supervise, wait_ready

# What `pdmesh up` prints once it is up: a line a service, then READY (`read_services` reads them).
SERVICE_LINE = re.compile(
    r"\s+(?P<name>(?P<role>prefill|decode|router|kvstore)(?:-\d+(?:-dp\d+)?)?): (?P<address>\S+) "
    r"\(pid (?P<pid>\d+)\)"
    r"(?:, metrics (?P<metrics>\S+))?"
)
READY = "Ctrl-C stops everything."


@dataclass(frozen=True)
class Service:
    """One service of a running `pdmesh up`, as it lists them."""

    name: str
    role: str  # prefill | decode | router | kvstore
    address: str
    pid: int
    metrics: str | None  # its /metrics URL (workers, the KV store)


def quiet_up(port: int, *argv: str, http_port: int = 0) -> list[str]:
    """The command line of `pdmesh up ARGV` with the router's gRPC on `port`, asking nothing once
    up (what the benchmarks and tests start)."""
    flags = ["--port", str(port), "--http-port", str(http_port), "--ask", ""]
    return pdmesh_command("up", *flags, *argv)


def read_services(
    lines: Iterable[str], sink: Callable[[str], object] | None = None
) -> list[Service]:
    """The services a `pdmesh up` lists on `lines` (its stdout), read until it says it is up
    (RuntimeError if the lines end first: it exited). Every line goes to `sink` too, and a daemon
    thread then keeps reading the rest into it, so that the pipe never fills up and blocks it."""
    sink = sink or (lambda line: None)
    stream = iter(lines)
    services = []
    for line in stream:
        sink(line)
        if m := SERVICE_LINE.match(line):
            pid, metrics = int(m["pid"]), m["metrics"]
            services.append(Service(m["name"], m["role"], m["address"], pid, metrics))
        elif line.startswith(READY):

            def pump() -> None:
                for rest in stream:
                    sink(rest)

            threading.Thread(target=pump, daemon=True).start()
            return services
    raise RuntimeError("pdmesh up exited before it was up")


class GpuPlacement:
    """Which GPUs each worker gets: consecutive devices in start order (prefill workers, then
    decode workers), a worker of TP size N taking N of them; once they run out, the next worker
    starts again from the first. Workers get `--device cuda:K` (their ranks take K .. K+N-1), so
    every process sees every GPU and NCCL finds the direct GPU-to-GPU path between them."""

    def __init__(self, device: str | None) -> None:
        import torch

        if device is None or device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = device.startswith("cuda")
        self.count = torch.cuda.device_count() if on_gpu else 0
        self.first = int(device.split(":", 1)[1]) if on_gpu and ":" in device else 0
        self.next = self.first

    def take(self, tp: int) -> range | None:
        """The GPUs of the next worker (None on the CPU)."""
        if self.count == 0:
            return None
        if self.next + tp > self.count:
            self.next = self.first
        devices = range(self.next, self.next + tp)
        self.next += tp
        return devices


def pair_transports(name: str, prefill: dict[str, range | None], decode: range | None) -> list[str]:
    """A decode worker's --kv-transport flags. `auto` picks per prefill worker: nccl between
    workers on different GPUs, tcp otherwise (CPU workers, or two sharing a GPU, which NCCL
    cannot pair); the commonest choice is the default, the others `--kv-transport-for`."""
    if name != "auto":
        return ["--kv-transport", name]
    chosen = {
        address: "nccl" if devices and decode and not set(devices) & set(decode) else "tcp"
        for address, devices in prefill.items()
    }
    counts = Counter(chosen.values())
    default = max(counts, key=counts.__getitem__) if counts else "tcp"
    flags = ["--kv-transport", default]
    for address, transport in chosen.items():
        if transport != default:
            flags += ["--kv-transport-for", f"{address}={transport}"]
    return flags


def pdmesh_command(*argv: str) -> list[str]:
    """The command line that runs `pdmesh ARGV` with this Python."""
    return [sys.executable, "-m", "pdmesh.cli", *argv]


def _worker(role: str, name: str, host: str, flags: list[str]) -> ProcessSpec:
    """A prefill or decode worker (or a data-parallel rank of one) on free ports, with its
    /metrics endpoint."""
    port, metrics_port = free_port(host), free_port(host)
    argv = [role, "--host", host, "--port", str(port), "--metrics-port", str(metrics_port)]
    return ProcessSpec(
        name,
        pdmesh_command(*argv, *flags),
        f"{host}:{port}",
        f"http://{host}:{metrics_port}/metrics",
        warm=True,
    )


def _layout(args: argparse.Namespace, role: str) -> dict[str, int]:
    """A pool's tensor-, pipeline- and data-parallel sizes (--prefill-tp, --decode-pp,
    --decode-dp, ...; default: --tensor-parallel-size, --pipeline-parallel-size and
    --data-parallel-size)."""
    tp = getattr(args, f"{role}_tp") or args.tensor_parallel_size
    pp = getattr(args, f"{role}_pp") or args.pipeline_parallel_size
    dp = getattr(args, f"{role}_dp") or args.data_parallel_size
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": dp}


def _ranks(layout: dict[str, int]) -> int:
    """The GPUs one worker process (one data-parallel rank) of `layout` takes."""
    return layout["tensor_parallel_size"] * layout["pipeline_parallel_size"]


def _pool_worker(
    role: str,
    index: int,
    host: str,
    layout: dict[str, int],
    flags: Callable[[range | None], list[str]],
    gpus: GpuPlacement,
    command: str | None = None,
) -> list[tuple[ProcessSpec, range | None]]:
    """A pool's worker: one process, or one per data-parallel rank (`role-I-dpR`, each a worker
    of its own to the router, rank 0 listening for the others), with their GPUs. `command`: the
    subcommand, when not `role` (`worker`, which takes either role)."""
    size = layout["data_parallel_size"]
    if size == 1:
        devices = gpus.take(_ranks(layout))
        return [(_worker(command or role, f"{role}-{index}", host, flags(devices)), devices)]
    address = f"{host}:{free_port(host)}"
    out = []
    for rank in range(size):
        devices = gpus.take(_ranks(layout))
        dp = ["--data-parallel-rank", str(rank), "--data-parallel-address", address]
        out.append(
            (_worker(role, f"{role}-{index}-dp{rank}", host, [*flags(devices), *dp]), devices)
        )
    return out


def _engine(options: dict[str, Any], layout: dict[str, int], devices: range | None) -> list[str]:
    """One worker's engine flags: its pool's layout and the worker's first GPU."""
    options = {**options, **layout}
    if devices is not None:
        options = {**options, "device": f"cuda:{devices.start}"}
    return engine_argv(options)


def _router(
    args: argparse.Namespace, prefill: list[str], decode: list[str], store: list[str]
) -> ProcessSpec:
    argv = ["router", "--host", args.host, "--port", str(args.port), *store]
    argv += ["--http-port", str(args.http_port), "--prefill", ",".join(prefill)]
    argv += ["--decode", ",".join(decode), "--policy", args.policy]
    planner_config(args)  # bad planner flags: refused here, not by the router's process
    argv += ["--disagg-min-tokens", str(args.disagg_min_tokens), *planner_argv(args)]
    if args.tool_call_parser:
        argv += ["--tool-call-parser", args.tool_call_parser]
    if args.model:
        argv += ["--model", args.model]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    argv += tls_argv(args)
    if args.public_client_auth:
        argv.append("--public-client-auth")
    if args.api_keys_file:
        argv += ["--api-keys-file", args.api_keys_file]
    env = envs.with_flag_env("api_keys", args.api_keys) if args.api_keys else None
    address = f"{args.host}:{args.port}"
    return ProcessSpec("router", pdmesh_command(*argv), address, env=env, restart=False)


def _kvstore(args: argparse.Namespace) -> ProcessSpec:
    """A KV store on free ports (gRPC, data plane, /metrics), with the mesh's TLS."""
    port, data_port, metrics_port = (free_port(args.host) for _ in range(3))
    argv = ["kvstore", "--host", args.host, "--port", str(port), "--data-port", str(data_port)]
    argv += ["--metrics-port", str(metrics_port), "--capacity-gib", str(args.kvstore_capacity_gib)]
    return ProcessSpec(
        "kvstore",
        pdmesh_command(*argv, *tls_argv(args)),
        f"{args.host}:{port}",
        f"http://{args.host}:{metrics_port}/metrics",
        warm=True,
    )


def plan_mesh(args: argparse.Namespace) -> list[ProcessSpec]:
    """The services of `pdmesh up ARGS`, in start order: the KV store (--kvstore), prefill
    workers, decode workers, the router (the one whose exit stops the mesh)."""
    options, tls = engine_options(args), tls_argv(args)
    if options["nnodes"] != 1:
        raise ValueError(
            "pdmesh up runs every worker on this machine: start a worker over several nodes "
            "with pdmesh decode / pdmesh prefill --nnodes N --node-rank R on each node."
        )
    decode_flags = ["--max-waiting-requests", str(args.max_waiting_requests)]
    decode_flags += ["--prefill-timeout", str(args.prefill_timeout)]
    gpus = GpuPlacement(args.device)
    if args.kvstore and any(_ranks(_layout(args, role)) != 1 for role in ("prefill", "decode")):
        raise ValueError("pdmesh up --kvstore needs workers of one rank for now (TP and PP 1).")
    specs: list[ProcessSpec] = [_kvstore(args)] if args.kvstore else []
    # Every worker reads through the store and publishes to it; the router counts its hits.
    store = ["--kvstore", specs[0].address] if args.kvstore else []
    if args.planner:
        return [*specs, *_either_role_workers(args, options, decode_flags, gpus, store)]
    prefill: dict[str, range | None] = {}  # address -> GPUs
    layout = _layout(args, "prefill")

    def prefill_flags(devices: range | None) -> list[str]:
        return [*_engine(options, layout, devices), *tls, *store]

    for i in range(0 if args.colocated else args.prefill):
        for spec, devices in _pool_worker("prefill", i, args.host, layout, prefill_flags, gpus):
            specs.append(spec)
            prefill[spec.address] = devices
    decode: list[str] = []
    decode_layout = _layout(args, "decode")

    def decode_flags_for(devices: range | None) -> list[str]:
        flags = [*decode_flags, *_engine(options, decode_layout, devices), *tls, *store]
        return flags + pair_transports(args.kv_transport, prefill, devices)

    for i in range(args.decode):
        for spec, _ in _pool_worker("decode", i, args.host, decode_layout, decode_flags_for, gpus):
            specs.append(spec)
            decode.append(spec.address)
    return [*specs, _router(args, list(prefill), decode, store)]


def _either_role_workers(
    args: argparse.Namespace,
    options: dict[str, Any],
    decode_flags: list[str],
    gpus: GpuPlacement,
    store: list[str],
) -> list[ProcessSpec]:
    """`pdmesh up --planner`: the prefill and decode pools as workers of either role (`pdmesh
    worker --role ...`), whose roles the router's planner switches, then the router. Any worker
    may push KV to any other, so each takes `--kv-transport` as given (`auto`: nccl for a GPU
    cache, else tcp) rather than a transport per pair."""
    roles = {role: _layout(args, role) for role in ("prefill", "decode")}
    if any(_ranks(x) != 1 or x["data_parallel_size"] != 1 for x in roles.values()):
        raise ValueError(
            "pdmesh up --planner starts workers that change role, which run one rank for now "
            "(no tensor, pipeline or data parallelism)."
        )
    specs: list[ProcessSpec] = []
    pools: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (
        ("prefill", 0 if args.colocated else args.prefill),
        ("decode", args.decode),
    ):

        def flags(devices: range | None, role: str = role) -> list[str]:
            engine = _engine(options, roles[role], devices)
            transport = ["--kv-transport", args.kv_transport]
            return ["--role", role, *decode_flags, *engine, *tls_argv(args), *store, *transport]

        for i in range(count):
            for spec, _ in _pool_worker(role, i, args.host, roles[role], flags, gpus, "worker"):
                specs.append(spec)
                pools[role].append(spec.address)
    return [*specs, _router(args, pools["prefill"], pools["decode"], store)]


def wait_for_workers(
    router: RouterClient | str, prefill: int, decode: int, children: list[Child], timeout_s: float
) -> None:
    """Until the router has this many workers in rotation (RuntimeError if a child exits,
    TimeoutError after `timeout_s`)."""
    client = router if isinstance(router, RouterClient) else RouterClient(router)
    wait_ready(children, lambda: client.has_workers(prefill, decode), timeout_s, "the mesh")


def wait_for_kvstore(children: list[Child], tls: TLSConfig | None, timeout_s: float) -> None:
    """Until the KV store among `children`, if there is one, serves."""
    stores = [c.address for c in children if c.name == "kvstore"]

    def serving() -> bool:
        return all(healthcheck.check(a, tls=tls)[0] == healthcheck.SERVING for a in stores)

    if stores:
        wait_ready(children, serving, timeout_s, "the KV store")


def _print_endpoints(args: argparse.Namespace, client: RouterClient, children: list[Child]) -> None:
    print(f"pdmesh is up: gRPC {client.target} (pdmesh.v1.Generation)", flush=True)
    if args.http_port:
        scheme = "https" if client.tls is not None else "http"
        base = f"{scheme}://{args.host}:{args.http_port}"
        print(f"  OpenAI-compatible HTTP: {base}/v1, metrics {base}/metrics", flush=True)
    for c in children[:-1]:
        print(f"  {c.name}: {c.address} (pid {c.proc.pid}), metrics {c.metrics}", flush=True)
    router = children[-1]
    print(f"  router: {router.address} (pid {router.proc.pid})", flush=True)


def run_up(args: argparse.Namespace) -> int:
    """`pdmesh up`: start the mesh, say where it is, keep it running until a signal; the exit
    code (1 when it did not come up or its router exited)."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    client = RouterClient.from_args(args)  # before any child starts: bad TLS or keys fail here
    children = [spawn(spec) for spec in plan_mesh(args)]
    try:
        roles = Counter(c.name.split("-", 1)[0] for c in children)
        wait_for_workers(client, roles["prefill"], roles["decode"], children, args.ready_timeout)
        wait_for_kvstore(children, client.tls, args.ready_timeout)
        _print_endpoints(args, client, children)
        if args.ask:
            print(f"Q: {args.ask}\nA: {client.ask(args.ask)}", flush=True)
        print(READY, flush=True)
        while not stopping:
            if not supervise(children):
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"pdmesh: {e}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
