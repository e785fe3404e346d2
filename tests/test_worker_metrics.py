"""Worker deaths counted where an operator looks: the only decode worker of a mesh is killed
(SIGKILL) mid-stream; the request it served fails, `pdmesh up` restarts the worker after the
shortest back-off, and the router's /metrics count the worker leaving the rotation, its restart
(a new process) and the request failed by the loss; the worker serves again afterwards."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from mesh_support import Mesh, start_mesh
from service_support import wait_until

from pdmesh.supervisor import RESTART_BASE_S
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def mesh(tiny_model) -> Iterator[Mesh]:
    # A request whose worker is lost fails at once (no failover): otherwise it waits for the
    # worker's restart, which a warm start (pdmesh/warm_start.py) may bring back in time.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDMESH_MAX_FAILOVERS", "0")
        m = start_mesh(
            "--model",
            str(tiny_model("llama")),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--kv-cache-tokens",
            "4096",
            http=True,
        )
    try:
        yield m
    finally:
        m.stop()


def _value(mesh: Mesh, name: str, **labels: str) -> float:
    return mesh.router_metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def _generate(stub: generation_pb2_grpc.GenerationStub, max_tokens: int) -> Iterator[object]:
    req = gen_pb.GenerateRequest(
        text="t1 t2 t3",
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return stub.Generate(req, timeout=60)


def test_a_killed_worker_is_counted_down_restarted_and_its_request_failed(mesh: Mesh) -> None:
    decode = mesh.decode[0]
    labels = {"role": "decode", "worker": decode}
    wait_until(lambda: _value(mesh, "pdmesh_router_worker_up", **labels) == 1, 30, "decode up")
    assert _value(mesh, "pdmesh_router_worker_down_total", **labels) == 0
    assert _value(mesh, "pdmesh_router_worker_restarts_total", **labels) == 0
    assert _value(mesh, "pdmesh_router_requests_failed_worker_lost_total") == 0

    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream = _generate(stub, 400)
        next(stream)  # the request runs on the worker
        assert _value(mesh, "pdmesh_router_worker_streams", worker=decode) == 1
        os.kill(mesh.pids[decode], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()

        wait_until(
            lambda: _value(mesh, "pdmesh_router_worker_restarts_total", **labels) == 1,
            120,
            "the router counted the restart",
        )
        back_after_s = time.monotonic() - killed_at
        assert _value(mesh, "pdmesh_router_worker_down_total", **labels) == 1
        assert _value(mesh, "pdmesh_router_worker_up", **labels) == 1
        assert _value(mesh, "pdmesh_router_requests_failed_worker_lost_total") == 1
        # Nothing else was counted: the prefill worker stayed up.
        prefill = {"role": "prefill", "worker": mesh.prefill[0]}
        assert _value(mesh, "pdmesh_router_worker_down_total", **prefill) == 0
        assert _value(mesh, "pdmesh_router_worker_restarts_total", **prefill) == 0

        replies = list(_generate(stub, 4))  # served by the new process
        assert replies[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
        # Neither the lost request nor the served one is still booked on the worker.
        assert _value(mesh, "pdmesh_router_worker_streams", worker=decode) == 0
    restarting = [line for line in mesh.output if "restarting in" in line]
    assert len(restarting) == 1 and f"restarting in {RESTART_BASE_S:.0f} s" in restarting[0]
    assert back_after_s < 90
