"""`pdmesh role WORKER prefill|decode`: switch a worker's role through its router.

The router owns roles (it dispatches by them): it refuses an unknown role or worker, a worker
started as `pdmesh decode` or `pdmesh prefill` (one role only), and the last worker of a role in
rotation; otherwise the worker finishes its old role's work (a decode worker moves its running
requests to the other decode workers with their KV; a prefill worker finishes its prefills)
and the router sends it its new role's. Returns once switched. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from pdmesh.flags import tls_args, tls_config
from pdmesh.serving.auth import bearer_metadata
from pdmesh.serving.grpc_server import blocking_channel
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


def add_role(sub: Any) -> None:
    r = sub.add_parser("role", help="switch a worker between prefill and decode")
    r.add_argument("worker", help="HOST:PORT of the worker, as its router knows it")
    r.add_argument("role", help="prefill | decode")
    r.add_argument("--router", default="127.0.0.1:50051", help="HOST:PORT of the router's gRPC API")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the switch")
    r.add_argument("--api-key", default=None, help="the router's API key (PDMESH_API_KEY)")
    tls_args(r)
    r.set_defaults(func=cmd_role)


def cmd_role(args: argparse.Namespace) -> int:
    """0 once switched (a line saying what moved), 1 when refused or failed."""
    metadata = bearer_metadata(args.api_key)
    request = worker_pb2.SetWorkerRoleRequest(worker=args.worker, role=args.role)
    with blocking_channel(args.router, tls_config(args)) as ch:
        try:
            reply = worker_pb2_grpc.MeshControlStub(ch).SetWorkerRole(
                request, timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as e:  # a sync call's error is also a grpc.Call
            detail = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
            print(f"{args.worker}: role not changed: {detail}", file=sys.stderr)
            return 1
    if not reply.previous:
        print(f"{args.worker}: serves {reply.role} already")
    elif reply.role == "prefill":
        print(
            f"{args.worker}: now serves prefill; {reply.migrated} requests moved to other decode "
            f"workers with their KV, {reply.recomputed} recomputed elsewhere"
        )
    else:
        print(
            f"{args.worker}: now serves decode; {reply.prefills_finished} prefills finished first"
        )
    return 0
