"""`pdmesh drain HOST:PORT`: drain a decode worker (live migration).

The worker stops admitting requests (NOT_SERVING, Submits refused) and hands each running
request, with its KV cache, to another decode worker, which continues its stream; requests that
cannot move with their KV are recomputed elsewhere. Returns once none is left there; the worker
stays up, idle and NOT_SERVING, until it is stopped. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from pdmesh.flags import tls_args, tls_config
from pdmesh.serving.grpc_server import blocking_channel
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


def add_drain(sub: Any) -> None:
    d = sub.add_parser("drain", help="move a decode worker's running requests to the others")
    d.add_argument("target", help="HOST:PORT of a decode worker (its gRPC port)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the drain")
    tls_args(d)
    d.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    """0 when drained (a line with the counts), 1 when the worker could not be drained."""
    with blocking_channel(args.target, tls_config(args)) as ch:
        try:
            reply = worker_pb2_grpc.DecodeWorkerStub(ch).Drain(
                worker_pb2.DrainRequest(), timeout=args.timeout
            )
        except grpc.RpcError as e:  # a sync call's error is also a grpc.Call
            detail = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
            print(f"{args.target}: drain failed: {detail}", file=sys.stderr)
            return 1
    print(
        f"{args.target}: drained; {reply.migrated} requests migrated with their KV, "
        f"{reply.recomputed} recomputed elsewhere"
    )
    return 0
