"""Live migration: a decode worker drained mid-stream (SIGTERM with --drain-on-sigterm, or
`pdmesh drain`) hands its running requests, with their KV, to another decode worker; every
client stream goes on with no token missing or repeated and no recompute, equal to an
undisturbed run (greedy, seeded, penalties with logprobs, a grammar); no block stays in use;
the drained worker exits cleanly. A hand-over whose KV push fails falls back to a recompute on
the target, with the same output."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from otlp_receiver import OTLPReceiver
from prometheus_client.parser import text_string_to_metric_families
from service_support import Service, router_workers, wait_until, wait_workers
from stream_kinds import (
    CHOICES,
    GRAMMAR,
    GREEDY,
    MAX_TOKENS,
    SEEDED,
    SHAPED,
    eos_model,
    reference_params,
    request,
    stream_prompts,
)

from pdmesh import LLM
from pdmesh.errors import FIELD_METADATA
from pdmesh.processes import free_port
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory) -> str:
    return eos_model(tiny_model, tmp_path_factory)


class Mesh:
    """A router and three decode workers (no prefill pool): `a` drains on SIGTERM, `b` takes
    its requests and is drained in turn with `pdmesh drain`, towards `bad`, whose KV data plane
    is advertised where nothing listens (every push to it fails after its 2 s --kv-timeout)."""

    def __init__(self, folder: str, logs: Path):
        self.spans = OTLPReceiver()
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.spans.endpoint}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        engine = ["--model", folder, "--kv-cache-tokens", "8192"]
        dead = ["--kv-advertise", f"127.0.0.1:{free_port()}", "--kv-timeout", "2"]

        def decode(name: str, *flags: str) -> Service:
            argv = ["--port", str(free_port()), *engine, *flags]
            return Service("decode", argv, logs / f"{name}.log", env=otel)

        self.a = decode("a", "--drain-on-sigterm")
        self.b_metrics = free_port()
        self.b = decode("b", "--metrics-port", str(self.b_metrics))
        self.bad = decode("bad", *dead)
        addresses = ",".join(s.address for s in (self.a, self.b, self.bad))
        self.router = Service(
            "router",
            [
                "--port",
                str(free_port()),
                "--http-port",
                "0",
                "--decode",
                addresses,
                "--model",
                folder,
            ],
            logs / "router.log",
            env=otel,
        )
        self.services = [self.a, self.b, self.bad, self.router]

    def start(self) -> Mesh:
        for s in self.services:
            s.start()
        for s in self.services:
            s.wait_serving()
        wait_workers(self.router.address, 0, 3)
        return self

    def stop(self) -> None:
        running = [s for s in self.services if s.proc is not None and s.proc.poll() is None]
        for s in running:  # all at once: each stop waits for its process
            assert s.proc is not None
            s.proc.terminate()
            os.kill(s.proc.pid, signal.SIGCONT)  # a frozen worker must hear it
        for s in running:
            s.stop()
        self.spans.stop()

    def freeze(self, s: Service) -> None:
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGSTOP)

    def thaw(self, s: Service) -> None:
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGCONT)

    def workers_in_rotation(self, n: int) -> None:
        wait_until(lambda: router_workers(self.router.address) == (0, n), 15, f"{n} in rotation")


@pytest.fixture(scope="module")
def mesh(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(folder, tmp_path_factory.mktemp("logs"))
    try:
        yield m.start()
    finally:
        m.stop()


async def _streams_moved(
    mesh: Mesh, source: Service, target: Service, prompts: list, kinds: list, drain: Any
) -> list[list[gen_pb.GenerateResponse]]:
    """Run the requests on `source` alone (`target` frozen, out of the rotation, as any other
    decode worker is by then), then with every stream under way: `source` frozen, `target`
    back, `drain()` (which thaws `source`). The streams' responses."""
    streams: list[list[gen_pb.GenerateResponse]] = [[] for _ in prompts]
    mesh.freeze(target)
    mesh.workers_in_rotation(1)
    async with grpc.aio.insecure_channel(mesh.router.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> None:
            async for r in stub.Generate(request(prompts[i], kinds[i]), timeout=120):
                streams[i].append(r)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        while min(sum(len(r.token_ids) for r in s) for s in streams) < 5:
            await asyncio.sleep(0.002)
        mesh.freeze(source)
        for s in streams:  # every stream is still running on the source
            assert sum(len(r.token_ids) for r in s) < MAX_TOKENS
        await asyncio.to_thread(mesh.workers_in_rotation, 0)
        mesh.thaw(target)
        await asyncio.to_thread(mesh.workers_in_rotation, 1)
        await asyncio.to_thread(drain)
        await asyncio.gather(*tasks)
    return streams


def _check_outputs(folder: str, streams: list, prompts: list, kinds: list) -> None:
    # One batch: seeded and greedy outputs do not depend on the batch (test_sampling.py).
    with LLM(folder, kv_cache_tokens=8192) as reference:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        references = reference.generate(inputs, [reference_params(k) for k in kinds])
    for stream, prompt, kind, expected in zip(streams, prompts, kinds, references, strict=True):
        for choice in expected.outputs:
            chunks = [r for r in stream if r.index == choice.index]
            assert [t for r in chunks for t in r.token_ids] == choice.token_ids
            assert "".join(r.text for r in chunks) == choice.text
            assert chunks[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
        if kind is SHAPED:  # every token streamed has its logprobs once, across the move
            assert sum(len(r.logprobs) for r in stream) == MAX_TOKENS
        usage = stream[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            len(prompt),
            MAX_TOKENS * len(expected.outputs),
        )


def test_bad_migration_calls_are_refused_naming_the_field(mesh: Mesh) -> None:
    """A Submit that names a migration without what it needs, and a Migrate of a handle nobody
    gave: refused with a clear status; the worker stays healthy and holds no block."""
    with grpc.insecure_channel(mesh.bad.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        bad_submits = {
            "migrate_from": worker_pb2.DecodeRequest(
                request_id="r1", prompt_token_ids=[1, 2, 3], num_output_tokens_sent=1,
                migrate_from=worker_pb2.MigrateFrom(address="127.0.0.1:1"),
            ),
            "num_output_tokens_sent": worker_pb2.DecodeRequest(
                request_id="r2", prompt_token_ids=[1, 2, 3],
                migrate_from=worker_pb2.MigrateFrom(address="127.0.0.1:1", handle="h"),
            ),
        }  # fmt: skip
        for field, request in bad_submits.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Submit(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(info.value.trailing_metadata())[FIELD_METADATA] == field
        with pytest.raises(grpc.RpcError) as info:
            stub.Migrate(worker_pb2.MigrateRequest(handle="nobody-gave-this"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nobody-gave-this" in info.value.details()
    assert mesh.bad.serving()
    assert mesh.bad.stats().kv_blocks_used == 0


def test_sigterm_migrates_eight_streams_with_their_kv(mesh: Mesh, folder: str) -> None:
    prompts = stream_prompts(8, 5)
    kinds = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY, SEEDED, SHAPED, GRAMMAR]
    mesh.freeze(mesh.bad)  # out of the rotation for this test
    mesh.workers_in_rotation(2)
    a = mesh.a.proc
    assert a is not None

    def drain() -> None:
        a.send_signal(signal.SIGTERM)  # handled once thawed
        mesh.thaw(mesh.a)

    streams = asyncio.run(_streams_moved(mesh, mesh.a, mesh.b, prompts, kinds, drain))
    assert a.wait(30) == 0  # the drained worker exits cleanly
    log = mesh.a.log.read_text()
    assert not [line for line in log.splitlines() if line.startswith("ERROR")], log[-3000:]
    b = mesh.b.stats()
    # Every request continued with its KV: nothing prefilled or recomputed on the target.
    assert (b.migrations_in, b.migration_fallbacks) == (8, 0)
    assert b.local_prefills == b.remote_prefills == 0
    assert b.migration_bytes_received > 0
    wait_until(lambda: mesh.b.stats().kv_blocks_used == 0, 5, "no block held")
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.b_metrics}/metrics", timeout=5) as r:
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(r.read().decode())
            for sample in family.samples
        }
    inbound = (("direction", "in"),)
    assert samples["pdmesh_migrations_total", (*inbound, ("result", "migrated"))] == 8
    assert samples["pdmesh_migration_bytes_total", inbound] == b.migration_bytes_received
    assert samples["pdmesh_migration_duration_seconds_count", inbound] == 8

    # A span per migration on each side, the sending one in the receiving one's trace.
    def named(name: str) -> list:
        return [s for s in list(mesh.spans.spans) if s.name == name]

    wait_until(lambda: len(named("decode.migrate_in")) == 8, 10, "migrate_in spans")
    ins = named("decode.migrate_in")
    outs = {s.trace_id: s for s in named("decode.migrate_out")}  # exported as `a` exited
    assert len(outs) == 8
    for span in ins:
        assert span.attributes["pdmesh.migration.result"] == "migrated"
        out = outs[span.trace_id]
        assert out.attributes["pdmesh.kv.bytes"] == span.attributes["pdmesh.kv.bytes"] > 0
    _check_outputs(folder, streams, prompts, kinds)


def test_failed_push_falls_back_to_recompute(mesh: Mesh, folder: str) -> None:
    mesh.a.stop()  # drained by the test above, or stopped here when this one runs alone
    prompts = stream_prompts(4, 5)
    kinds = [GREEDY, SEEDED, SHAPED, CHOICES]
    drained: list[subprocess.CompletedProcess[str]] = []

    def drain() -> None:
        cmd = [sys.executable, "-m", "pdmesh.cli", "drain", mesh.b.address]
        mesh.thaw(mesh.b)
        drained.append(subprocess.run(cmd, capture_output=True, text=True, timeout=60))

    streams = asyncio.run(_streams_moved(mesh, mesh.b, mesh.bad, prompts, kinds, drain))
    (done,) = drained
    assert done.returncode == 0, done.stderr
    assert "0 requests migrated with their KV, 4 recomputed" in done.stdout
    # `pdmesh drain` leaves the worker up, idle and out of the rotation.
    assert not mesh.b.serving()
    b = mesh.b.stats()
    assert b.draining and b.kv_blocks_used == 0
    assert (b.migrations_out, b.migration_fallbacks) == (0, 4)
    bad = mesh.bad.stats()
    assert (bad.migrations_in, bad.migration_fallbacks) == (0, 3)
    wait_until(lambda: mesh.bad.stats().kv_blocks_used == 0, 5, "no block held")
    assert router_workers(mesh.router.address) == (0, 1)
    _check_outputs(folder, streams, prompts, kinds)


def test_kubernetes_decode_pods_drain_before_they_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode StatefulSet's preStop hook is a real `pdmesh drain` command line, its SIGTERM
    drains too, and the grace period outlasts the hook's timeout."""
    import yaml

    from pdmesh.cli import build_parser
    from pdmesh.drain import cmd_drain

    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/decode.yaml").read_text()))
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "pdmesh"
    args = build_parser().parse_args(command[1:])
    assert args.func is cmd_drain and args.target.endswith(":50061")
    assert pod["terminationGracePeriodSeconds"] > args.timeout
    env = {e["name"]: e.get("value") for e in container["env"]}
    monkeypatch.setenv("PDMESH_DRAIN_ON_SIGTERM", env["PDMESH_DRAIN_ON_SIGTERM"])
    assert build_parser().parse_args(["decode"]).drain_on_sigterm is True
