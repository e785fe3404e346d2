"""`pdmesh up`: a router and its workers as separate local processes.

Children are started with PR_SET_PDEATHSIG so they die with this process even if it is killed
outright; on Ctrl-C or SIGTERM everything is stopped (SIGTERM, then SIGKILL after a grace).
TLS flags go to every child (each uses the same certificate as server and client); API keys go
to the router through its environment, not its command line.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from pdmesh import envs
from pdmesh.cli import tls_config
from pdmesh.serving.auth import ApiKeys, bearer_metadata
from pdmesh.serving.grpc_server import blocking_channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
RESTART_BASE_S = 2.0
RESTART_MAX_S = 30.0


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen[bytes]
    metrics: str | None = None  # its Prometheus endpoint
    argv: list[str] = field(default_factory=list)  # how to start it again
    env: dict[str, str] | None = None
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a scheduled restart


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in (
        "model",
        "dtype",
        "device",
        "tensor_parallel_size",
        "block_size",
        "kv_cache_tokens",
        "kv_cache_memory_fraction",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "seed",
        "load_format",
    ):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.enable_expert_parallel:
        flags.append("--enable-expert-parallel")
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.async_scheduling is not None:
        flags.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    return flags


class GpuPlacement:
    """Which GPUs each worker gets: consecutive devices in start order (prefill workers, then
    decode workers), a worker of TP size N taking N of them; once they run out, the next worker
    starts again from the first. Workers get `--device cuda:K` (their ranks take K .. K+N-1), so
    every process sees every GPU and NCCL finds the direct GPU-to-GPU path between them."""

    def __init__(self, device: str | None) -> None:
        import torch

        self.count = 0
        self.first = 0
        if (device in (None, "auto") and torch.cuda.is_available()) or (device or "").startswith(
            "cuda"
        ):
            self.count = torch.cuda.device_count()
            if device and ":" in device:
                self.first = int(device.split(":", 1)[1])
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


def device_flags(devices: range | None) -> list[str]:
    return ["--device", f"cuda:{devices.start}"] if devices is not None else []


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


def _with_tp(engine: list[str], size: int | None) -> list[str]:
    """The engine flags with one pool's tensor-parallel size (the last flag wins in argparse)."""
    return [*engine, "--tensor-parallel-size", str(size)] if size else engine


def _tls_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        value = getattr(args, name)
        if value:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def spawn(
    name: str,
    argv: list[str],
    address: str,
    metrics: str | None = None,
    env: dict[str, str] | None = None,
) -> Child:
    return Child(name, address, _start(argv, env), metrics, argv, env)


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pdmesh.cli", *argv], preexec_fn=_die_with_parent, env=env
    )


def supervise(children: list[Child]) -> bool:
    """One look at the children: restart dead workers (same address, backing off); False when
    the router is gone (nothing is served any more)."""
    now = time.monotonic()
    for c in children:
        if c.restart_at is not None and now >= c.restart_at:
            print(
                f"pdmesh: restarting {c.name} (restart {c.restarts})", file=sys.stderr, flush=True
            )
            c.proc = _start(c.argv, c.env)
            c.restart_at = None
            continue
        if c.restart_at is not None or c.proc.poll() is None:
            continue
        if c.name == "router":
            print(
                f"pdmesh: the router exited (code {c.proc.returncode}); stopping", file=sys.stderr
            )
            return False
        c.restarts += 1
        delay = min(RESTART_MAX_S, RESTART_BASE_S * 2 ** (c.restarts - 1))
        print(
            f"pdmesh: {c.name} exited (code {c.proc.returncode}); the router routes around it; "
            f"restarting in {delay:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        c.restart_at = now + delay
    return True


def spawn_worker(role: str, index: int, host: str, engine: list[str]) -> Child:
    """A prefill or decode worker on free ports, with its /metrics endpoint."""
    port, metrics_port = free_port(host), free_port(host)
    argv = [role, "--host", host, "--port", str(port), "--metrics-port", str(metrics_port)]
    return spawn(
        f"{role}-{index}",
        [*argv, *engine],
        f"{host}:{port}",
        f"http://{host}:{metrics_port}/metrics",
    )


def start_mesh(args: argparse.Namespace) -> list[Child]:
    host = args.host
    engine = [*_engine_flags(args), *_tls_flags(args)]
    decode_flags = [
        "--max-waiting-requests",
        str(args.max_waiting_requests),
        "--prefill-timeout",
        str(args.prefill_timeout),
    ]
    children: list[Child] = []
    prefill: dict[str, range | None] = {}  # address -> GPUs
    decode: list[str] = []
    gpus = GpuPlacement(args.device)
    for i in range(0 if args.colocated else args.prefill):
        devices = gpus.take(args.prefill_tp or args.tensor_parallel_size)
        flags = [*_with_tp(engine, args.prefill_tp), *device_flags(devices)]
        children.append(spawn_worker("prefill", i, host, flags))
        prefill[children[-1].address] = devices
    for i in range(args.decode):
        devices = gpus.take(args.decode_tp or args.tensor_parallel_size)
        flags = [
            *decode_flags,
            *_with_tp(engine, args.decode_tp),
            *device_flags(devices),
            *pair_transports(args.kv_transport, prefill, devices),
        ]
        children.append(spawn_worker("decode", i, host, flags))
        decode.append(children[-1].address)
    router = [
        "router",
        "--host",
        host,
        "--port",
        str(args.port),
        "--http-port",
        str(args.http_port),
        "--prefill",
        ",".join(prefill),
        "--decode",
        ",".join(decode),
        "--policy",
        args.policy,
        "--disagg-min-tokens",
        str(args.disagg_min_tokens),
    ]
    if args.model:
        router += ["--model", args.model]
    if args.max_model_len:
        router += ["--max-model-len", str(args.max_model_len)]
    router += _tls_flags(args)
    if args.public_client_auth:
        router.append("--public-client-auth")
    if args.api_keys_file:
        router += ["--api-keys-file", args.api_keys_file]
    env = envs.with_flag_env("api_keys", args.api_keys) if args.api_keys else None
    children.append(spawn("router", router, f"{host}:{args.port}", env=env))
    return children


@dataclass(frozen=True)
class RouterClient:
    """How this process reaches its router: address, TLS, an API key."""

    target: str
    tls: TLSConfig | None = None
    api_key: str | None = None

    def channel(self) -> grpc.Channel:
        return blocking_channel(self.target, self.tls)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.api_key)


def router_client(args: argparse.Namespace) -> RouterClient:
    keys = ApiKeys.from_flags(args.api_keys, args.api_keys_file)
    return RouterClient(
        f"{args.host}:{args.port}", tls_config(args), keys.keys[0] if keys.keys else None
    )


def wait_ready(
    router: RouterClient | str,
    prefill: int,
    decode: int,
    children: list[Child],
    timeout_s: float,
) -> None:
    """Until the router has this many workers in rotation (RuntimeError if a child exits)."""
    client = router if isinstance(router, RouterClient) else RouterClient(router)
    deadline = time.monotonic() + timeout_s
    with client.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode}")
            try:
                info = stub.GetModelInfo(
                    gen_pb.ModelInfoRequest(), timeout=2, metadata=client.metadata
                )
                if info.num_prefill_workers >= prefill and info.num_decode_workers >= decode:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the mesh was not ready within {timeout_s:.0f} s")


def stop_all(children: list[Child]) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def ask(client: RouterClient, question: str) -> str:
    with client.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(role="user", content=question)])
        req = gen_pb.GenerateRequest(
            chat=chat, sampling=gen_pb.SamplingParams(max_tokens=64, temperature=0)
        )
        stream = stub.Generate(req, timeout=120, metadata=client.metadata)
        return "".join(r.text for r in stream)


def run_up(args: argparse.Namespace) -> int:
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    client = router_client(args)  # before any child starts: bad TLS files or keys fail here
    children = start_mesh(args)
    target = client.target
    n_prefill = 0 if args.colocated else args.prefill
    try:
        wait_ready(client, n_prefill, args.decode, children, args.ready_timeout)
        print(f"pdmesh is up: gRPC {target} (pdmesh.v1.Generation)", flush=True)
        if args.http_port:
            scheme = "https" if client.tls is not None else "http"
            base = f"{scheme}://{args.host}:{args.http_port}"
            print(f"  OpenAI-compatible HTTP: {base}/v1, metrics {base}/metrics", flush=True)
        for c in children[:-1]:
            print(f"  {c.name}: {c.address} (pid {c.proc.pid}), metrics {c.metrics}", flush=True)
        router = children[-1]
        print(f"  router: {router.address} (pid {router.proc.pid})", flush=True)
        if args.ask:
            print(f"Q: {args.ask}\nA: {ask(client, args.ask)}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
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
