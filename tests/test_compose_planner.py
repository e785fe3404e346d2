"""The compose deployment whose worker pool the planner's roles move (docker-compose.planner.yml,
on CPU with docker-compose.planner.cpu.yml), run as local processes (Docker cannot run here):
the pool's workers, started by their own `pdmesh worker --role ...`, serve a request together
as prefill and decode worker and report their roles; one switches role by hand (`pdmesh role`,
through the router) and the router's planner returns it to its starting role once idle.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from compose_local import (
    COMPOSE_FILES,
    DEPLOY,
    LocalService,
    compose_config,
    healthy,
    plan,
    start,
    stop,
)
from otlp_receiver import OTLPReceiver
from service_support import router_workers

from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

PLANNER_FILES = (DEPLOY / "docker-compose.planner.yml", DEPLOY / "docker-compose.planner.cpu.yml")
FILES = (*COMPOSE_FILES, *PLANNER_FILES)
READY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def services(default_model_folder: Path) -> Iterator[dict[str, LocalService]]:
    receiver = OTLPReceiver()
    services = plan(
        compose_config(FILES),
        external={"jaeger:4317": receiver.endpoint},
        extra_env={"PDMESH_LOG_LEVEL": "WARNING"},
    )
    assert set(services) == {"router", "worker-0", "worker-1", "worker-2", "kvstore"}
    start(services)
    try:
        _wait_ready(services)
        yield services
    finally:
        stop(services)
        receiver.stop()
    for s in services.values():
        assert s.proc is not None and s.proc.returncode == 0, f"{s.name}:\n" + "".join(s.log[-30:])


def _router(services: dict[str, LocalService]) -> str:
    return services["router"].address_of("PDMESH_PORT")


def _wait_ready(services: dict[str, LocalService]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while router_workers(_router(services)) != (1, 2):
        for s in services.values():
            if s.proc is not None and s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited:\n" + "".join(s.log[-40:]))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the planner's compose mesh was not ready in {READY_TIMEOUT_S} s")
        time.sleep(0.5)


def _metrics(s: LocalService, port_var: str) -> str:
    with urllib.request.urlopen(f"http://{s.address_of(port_var)}/metrics", timeout=10) as r:
        return r.read().decode()


def test_the_pool_serves_as_prefill_and_decode_worker(services: dict[str, LocalService]) -> None:
    prompt = list(range(1000, 1100))  # past the 64-token threshold: a remote prefill
    request = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt),
        sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0),
    )
    with grpc.insecure_channel(_router(services)) as ch:
        stream = list(generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120))
    # worker-0 prefilled and pushed the KV to a decode worker at the name the file advertises.
    assert stream[-1].timings.disaggregated
    assert sum(len(r.token_ids) for r in stream) == 4
    for s in services.values():
        assert healthy(s), f"{s.name}: its compose health check failed"


def test_a_worker_switches_by_hand_and_the_planner_brings_it_back(
    services: dict[str, LocalService],
) -> None:
    starting = {"worker-0": "prefill", "worker-1": "decode", "worker-2": "decode"}
    for name, role in starting.items():
        text = _metrics(services[name], "PDMESH_METRICS_PORT")
        assert f'pdmesh_worker_role{{role="{role}"}} 1.0' in text, name
    router = services["router"]
    worker = services["worker-1"].address_of("PDMESH_PORT")  # as the router lists it
    role = [sys.executable, "-m", "pdmesh.cli", "role", "--router", _router(services)]
    out = subprocess.run([*role, worker, "prefill"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "now serves prefill" in out.stdout, out.stdout + out.stderr
    # Idle for --planner-sustain (3) looks of --planner-interval-s (2 s): back to decode.
    deadline = time.monotonic() + 60
    back = 'pdmesh_router_planner_switches_total{reason="idle",to_role="decode"} 1.0'
    while back not in (text := _metrics(router, "PDMESH_HTTP_PORT")):
        assert time.monotonic() < deadline, "the planner did not return the worker to decode"
        time.sleep(1)
    assert router_workers(_router(services)) == (1, 2)
    assert 'pdmesh_worker_role{role="decode"} 1.0' in _metrics(
        services["worker-1"], "PDMESH_METRICS_PORT"
    )
    for name, role in starting.items():
        address = services[name].address_of("PDMESH_PORT")
        assert f'pdmesh_router_worker_up{{role="{role}",worker="{address}"}} 1.0' in text
    # The planner measures attainment against its SLO for the intervals with requests.
    _serve_one(services)
    deadline = time.monotonic() + 30
    while 'pdmesh_router_slo_attainment{kind="ttft"}' not in _metrics(router, "PDMESH_HTTP_PORT"):
        assert time.monotonic() < deadline, "the router's planner measured nothing"
        time.sleep(1)


def _serve_one(services: dict[str, LocalService]) -> None:
    request = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=list(range(2000, 2010))),
        sampling=gen_pb.SamplingParams(max_tokens=2, temperature=0),
    )
    with grpc.insecure_channel(_router(services)) as ch:
        list(generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120))
