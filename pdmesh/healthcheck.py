"""`pdmesh healthcheck HOST:PORT`: exit 0 when the service's grpc.health.v1 status is SERVING.

What container health checks run (docker compose, Kubernetes exec probes): it imports no torch and
answers within its timeout, 1 when the service is not serving, 2 when it cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.flags import tls_args, tls_config
from pdmesh.serving.grpc_server import blocking_channel
from pdmesh.serving.tls import TLSConfig

SERVING = 0
NOT_SERVING = 1
UNREACHABLE = 2


def add_healthcheck(sub: Any) -> None:
    h = sub.add_parser("healthcheck", help="exit 0 when a pdmesh service at HOST:PORT is serving")
    h.add_argument("target", help="HOST:PORT of a router or worker (its gRPC port)")
    h.add_argument("--service", default="", help="a service name; '' (default): the whole server")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds")
    h.add_argument("--quiet", action="store_true", help="print nothing")
    tls_args(h)
    h.set_defaults(func=cmd_healthcheck)


def check(
    target: str, service: str = "", timeout_s: float = 3.0, tls: TLSConfig | None = None
) -> tuple[int, str]:
    """(exit code, what to print)."""
    with blocking_channel(target, tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:  # a sync call's error is also a grpc.Call
            return UNREACHABLE, f"{target}: {e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (SERVING if serving else NOT_SERVING), f"{target}: {status}"


def cmd_healthcheck(args: argparse.Namespace) -> int:
    code, message = check(args.target, args.service, args.timeout, tls_config(args))
    if not args.quiet:
        print(message, file=sys.stdout if code == SERVING else sys.stderr)
    return code
