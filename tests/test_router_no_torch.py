"""The router never loads torch or the engine: `pdmesh router` as a user starts it (its memory
maps hold no libtorch once it serves), and the router's `serve` run in a fresh interpreter (its
modules then hold neither `torch` nor `pdmesh.engine`, nor transformers)."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.processes import free_port

pytestmark = pytest.mark.timeout(120)


def test_router_process_maps_no_libtorch() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdmesh.cli",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--http-port",
            str(free_port()),
            "--decode",
            f"127.0.0.1:{free_port()}",  # nobody listens: the router serves all the same
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the router did not serve within 90 s"
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    time.sleep(0.05)
        with open(f"/proc/{proc.pid}/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "/" in line}
        assert not [lib for lib in libraries if "libtorch" in lib or "/torch/" in lib]
    finally:
        proc.terminate()
        proc.wait(30)


_SERVE_AND_REPORT = """
import asyncio, sys
from pdmesh.router.config import RouterConfig
from pdmesh.router.server import serve

def ready(port):
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
                   or m.startswith("pdmesh.engine"))
    print("HEAVY", heavy, flush=True)
    raise SystemExit(0)

config = RouterConfig(decode=("127.0.0.1:{decode}",), bind="127.0.0.1:{port}",
                      http_bind="127.0.0.1:{http}")
asyncio.run(serve(config, ready))
"""


def test_serving_router_imports_no_torch_and_no_engine() -> None:
    code = _SERVE_AND_REPORT.format(decode=free_port(), port=free_port(), http=free_port())
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("HEAVY")]
    assert lines == ["HEAVY []"], (done.stdout, done.stderr[-2000:])
