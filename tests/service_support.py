"""Single pdmesh services as processes (`pdmesh router|decode|prefill ...`), for tests that kill,
restart or rewire them one at a time, which `pdmesh up` does not let a test do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.supervisor import stop
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Service:
    role: str  # "router", "decode" or "prefill"
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.argv[self.argv.index('--port') + 1]}"

    def start(self) -> Service:
        env = {**os.environ, "PDMESH_LOG_LEVEL": "WARNING", **self.env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdmesh.cli", self.role, *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, 15)

    def serving(self) -> bool:
        try:
            with grpc.insecure_channel(self.address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_serving(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.serving():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} not serving:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stats(self) -> worker_pb2.WorkerStats:
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if self.role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub
        )
        with grpc.insecure_channel(self.address) as ch:
            return stub_cls(ch).GetStats(worker_pb2.StatsRequest(), timeout=10)


def router_workers(router: str) -> tuple[int, int] | None:
    """(prefill, decode) workers the router has in rotation; None while it does not answer."""
    with grpc.insecure_channel(router) as ch:
        try:
            info = generation_pb2_grpc.GenerationStub(ch).GetModelInfo(
                gen_pb.ModelInfoRequest(), timeout=2
            )
        except grpc.RpcError:
            return None
    return info.num_prefill_workers, info.num_decode_workers


def wait_workers(router: str, prefill: int, decode: int, timeout_s: float = 60) -> None:
    """Until the router has this many workers of each kind in rotation."""
    deadline = time.monotonic() + timeout_s
    while router_workers(router) != (prefill, decode):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router at {router} did not see its workers")
        time.sleep(0.2)


def wait_until(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def decode_via(
    decode: Service,
    prefill: Service,
    request_id: str,
    prompt: list[int],
    params: dict[str, object],
) -> list[int]:
    """Drive the decode worker as the router does, naming the prefill worker to use: the
    request's tokens (`params`: gen_pb.SamplingParams's fields)."""
    with grpc.insecure_channel(decode.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        updates = stub.Subscribe(worker_pb2.SubscribeRequest(subscriber_id=request_id))
        next(updates)  # the handshake
        stub.Submit(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                subscriber_id=request_id,
                prompt_token_ids=prompt,
                sampling=gen_pb.SamplingParams(**params),
                prefill_address=prefill.address,
                disagg_min_tokens=16,
            ),
            timeout=10,
        )
        tokens: list[int] = []
        for update in updates:
            for d in update.deltas:
                if d.request_id != request_id:
                    continue
                assert not d.error_code, d.error_message
                tokens += d.token_ids
                if d.finish_reason:
                    updates.cancel()
                    return tokens
    raise AssertionError("the update stream ended before the request finished")
