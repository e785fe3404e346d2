"""Roles that move: workers started as `pdmesh worker --role ...` switch between prefill and
decode by hand (`pdmesh role`, the router's SetWorkerRole) while streams run through them. A
decode worker turning prefill moves its running requests to the other decode workers with
their KV; every stream (greedy, seeded, penalties with logprobs, a grammar) equals an
undisturbed run, with no token lost or repeated; no block stays in use; back and forth, four
times. The router and the workers report the roles; bad switches are refused naming the field.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_support import Service, router_workers, wait_until, wait_workers
from stream_kinds import (
    GRAMMAR,
    GREEDY,
    MAX_TOKENS,
    REGEX,
    SEEDED,
    SHAPED,
    eos_model,
    reference_params,
    request,
    stream_prompts,
)
from tcp_proxy import TcpProxy

from pdmesh import LLM
from pdmesh.errors import FIELD_METADATA
from pdmesh.processes import free_port
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(360)  # a shared 2-core machine can be slow


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory) -> str:
    return eos_model(tiny_model, tmp_path_factory)


class Mesh:
    """A router; `a` and `b`, workers of either role started as decode workers (`a` with
    /metrics); `p`, one started as a prefill worker; `q`, a prefill worker of one role
    (`pdmesh prefill`)."""

    def __init__(self, folder: str, logs: Path) -> None:
        engine = ["--model", folder, "--kv-cache-tokens", "8192"]

        # INFO: a stream that stalled once here (2026-11-28, not reproduced since) leaves the
        # services' own account of it (`log_tails`).
        info = {"PDMESH_LOG_LEVEL": "INFO"}

        def worker(name: str, kind: str, *flags: str) -> Service:
            argv = ["--port", str(free_port()), *engine, *flags]
            return Service(kind, argv, logs / f"{name}.log", env=info)

        self.a_metrics = free_port()
        self.a = worker("a", "worker", "--role", "decode", "--metrics-port", str(self.a_metrics))
        self.b = worker("b", "worker", "--role", "decode")
        self.p = worker("p", "worker", "--role", "prefill")
        self.q = worker("q", "prefill")
        self.http = free_port()
        router = ["--port", str(free_port()), "--http-port", str(self.http), "--model", folder]
        router += ["--decode", f"{self.a.address},{self.b.address}"]
        router += ["--prefill", f"{self.p.address},{self.q.address}"]
        router += ["--disagg-min-tokens", "16"]  # most prompts prefilled by a prefill worker
        self.router = Service("router", router, logs / "router.log", env=info)
        self.services = [self.a, self.b, self.p, self.q, self.router]

    def start(self) -> Mesh:
        for s in self.services:
            s.start()
        for s in self.services:
            s.wait_serving()
        wait_workers(self.router.address, 2, 2)
        asyncio.run(self.warm_up())
        return self

    async def warm_up(self) -> None:
        """Short requests, half with a grammar, eight at once (spread over both decode workers
        and both prefill workers), so that the tests' streams start together: grammars
        compiled, KV links made."""
        requests = [request(p, dict(max_tokens=8, temperature=0)) for p in stream_prompts(8, 7)]
        for r in requests[::2]:
            r.sampling.structured_outputs.regex = REGEX
        async with grpc.aio.insecure_channel(self.router.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            await asyncio.gather(*(_drain(stub.Generate(r, timeout=60)) for r in requests))

    def stop(self) -> None:
        for s in self.services:  # all at once: each stop waits for its process
            if s.proc is not None and s.proc.poll() is None:
                s.proc.terminate()
        for s in self.services:
            s.stop()

    def set_role(self, worker: Service, role: str) -> worker_pb2.SetRoleReply:
        with grpc.insecure_channel(self.router.address) as ch:
            request = worker_pb2.SetWorkerRoleRequest(worker=worker.address, role=role)
            return worker_pb2_grpc.MeshControlStub(ch).SetWorkerRole(request, timeout=60)

    def role_command(self, worker: Service, role: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pdmesh.cli", "role", worker.address, role]
        cmd += ["--router", self.router.address]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of each service's log."""
        return "".join(
            f"\n--- {s.log.name}\n" + "\n".join(s.log.read_text().splitlines()[-lines:])
            for s in self.services
        )

    def router_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _scrape(self.http)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(r.read().decode())
            for sample in family.samples
        }


@pytest.fixture(scope="module")
def mesh(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(folder, tmp_path_factory.mktemp("logs"))
    try:
        yield m.start()
    finally:
        m.stop()


async def _drain(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass


def _roles(mesh: Mesh) -> dict[str, str]:
    return {name: getattr(mesh, name).stats().role for name in ("a", "b", "p")}


def test_bad_switches_are_refused_naming_the_field(mesh: Mesh) -> None:
    refusals = {
        (mesh.a.address, "router"): (grpc.StatusCode.INVALID_ARGUMENT, "role must be one of"),
        ("127.0.0.1:1", "prefill"): (grpc.StatusCode.NOT_FOUND, "worker '127.0.0.1:1' is not"),
        # A prefill worker of one role (`pdmesh prefill`) cannot take another.
        (mesh.q.address, "decode"): (grpc.StatusCode.FAILED_PRECONDITION, "serves only prefill"),
    }
    for (worker, role), (code, words) in refusals.items():
        with grpc.insecure_channel(mesh.router.address) as ch:
            request = worker_pb2.SetWorkerRoleRequest(worker=worker, role=role)
            with pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.MeshControlStub(ch).SetWorkerRole(request, timeout=30)
        assert info.value.code() == code, info.value.details()
        assert words in info.value.details()
    assert dict(info.value.trailing_metadata() or ()).get(FIELD_METADATA) is None
    with grpc.insecure_channel(mesh.router.address) as ch:
        request = worker_pb2.SetWorkerRoleRequest(worker=mesh.a.address, role="")
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.MeshControlStub(ch).SetWorkerRole(request, timeout=30)
    assert dict(info.value.trailing_metadata())[FIELD_METADATA] == "role"
    # A worker asked directly names the field too.
    with grpc.insecure_channel(mesh.a.address) as ch, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.WorkerRoleStub(ch).SetRole(
            worker_pb2.SetRoleRequest(role="both"), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())[FIELD_METADATA] == "role"
    # A worker's role as it is already: nothing to do.
    assert mesh.set_role(mesh.a, "decode") == worker_pb2.SetRoleReply(role="decode")
    assert _roles(mesh) == {"a": "decode", "b": "decode", "p": "prefill"}
    assert router_workers(mesh.router.address) == (2, 2)


def test_roles_switch_back_and_forth_mid_stream(mesh: Mesh, folder: str) -> None:
    prompts = stream_prompts(8, 7)
    kinds = [GREEDY, SEEDED, SHAPED, GRAMMAR] * 2
    streams: list[list[gen_pb.GenerateResponse]] = [[] for _ in prompts]
    replies: list[worker_pb2.SetRoleReply] = []

    def tokens(i: int) -> int:
        return sum(len(r.token_ids) for r in streams[i])

    async def run() -> None:
        async with grpc.aio.insecure_channel(mesh.router.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def one(i: int) -> None:
                async for r in stub.Generate(request(prompts[i], kinds[i]), timeout=180):
                    streams[i].append(r)

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            deadline = time.monotonic() + 120
            while min(tokens(i) for i in range(len(prompts))) < 5:
                failed = [t.exception() for t in tasks if t.done() and t.exception()]
                assert not failed, f"a stream failed before the switches: {failed[0]!r}"
                assert time.monotonic() < deadline, (
                    "streams stalled before any switch: tokens of the greedy, seeded, shaped and "
                    f"grammar streams, twice: {[tokens(i) for i in range(len(prompts))]}"
                    + mesh.log_tails()
                )
                await asyncio.sleep(0.002)
            # a: decode -> prefill (its streams move to b); p: prefill -> decode; b: decode ->
            # prefill (every stream moves to p); a: back to decode.
            for worker, role in ((mesh.a, "prefill"), (mesh.p, "decode"), (mesh.b, "prefill")):
                assert min(tokens(i) for i in range(len(prompts))) < MAX_TOKENS  # mid-stream
                replies.append(await asyncio.to_thread(mesh.set_role, worker, role))
                if worker is mesh.a:  # its /metrics say the role it serves now
                    samples = await asyncio.to_thread(_scrape, mesh.a_metrics)
                    assert samples["pdmesh_worker_role", (("role", "prefill"),)] == 1
                    assert ("pdmesh_worker_role", (("role", "decode"),)) not in samples
            done = await asyncio.to_thread(mesh.role_command, mesh.a, "decode")
            assert done.returncode == 0, done.stderr
            assert "now serves decode" in done.stdout
            await asyncio.gather(*tasks)

    asyncio.run(run())
    # The switches that moved streams moved them with their KV, nothing recomputed.
    assert [(r.role, r.previous) for r in replies] == [
        ("prefill", "decode"),
        ("decode", "prefill"),
        ("prefill", "decode"),
    ]
    assert replies[0].recomputed == replies[2].recomputed == 0
    assert replies[2].migrated > 0
    assert _roles(mesh) == {"a": "decode", "b": "prefill", "p": "decode"}
    # The router dispatches by the new roles: b and q prefill, a and p decode.
    wait_until(lambda: router_workers(mesh.router.address) == (2, 2), 10, "2 + 2 in rotation")
    for w in (mesh.a, mesh.b, mesh.p):
        wait_until(lambda w=w: w.stats().kv_blocks_used == 0, 10, f"no block held by {w.role}")
    _check_outputs(folder, streams, prompts, kinds)


def test_roles_are_reported_and_the_last_of_a_role_stays(mesh: Mesh) -> None:
    """After the switches above (a, p decode; b, q prefill), or from the start when run alone."""
    roles = _roles(mesh)
    decode = [getattr(mesh, n) for n in ("a", "b", "p") if roles[n] == "decode"]
    for w in decode[1:]:  # leave one decode worker that can switch
        mesh.set_role(w, "prefill")
    (last,) = decode[:1]
    with pytest.raises(grpc.RpcError) as info:
        mesh.set_role(last, "prefill")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "last decode worker" in info.value.details()
    assert last.stats().role == "decode"
    assert router_workers(mesh.router.address) == (3, 1)
    stats = mesh.a.stats()
    assert list(stats.roles) == ["prefill", "decode"]
    # The worker's /metrics and the router's say the role it serves now.
    samples = _scrape(mesh.a_metrics)
    assert samples["pdmesh_worker_role", (("role", stats.role),)] == 1
    assert samples["pdmesh_kv_blocks_used", (("role", stats.role),)] == 0
    router = mesh.router_metrics()
    up = {labels: v for (name, labels), v in router.items() if name == "pdmesh_router_worker_up"}
    for w in (mesh.a, mesh.b, mesh.p, mesh.q):
        role = w.stats().role
        assert up[(("role", role), ("worker", w.address))] == 1
        other = "decode" if role == "prefill" else "prefill"
        assert (("role", other), ("worker", w.address)) not in up
    switched = decode[1]  # to prefill, in this test
    switches = "pdmesh_router_worker_role_switches_total"
    assert router[switches, (("role", "prefill"), ("worker", switched.address))] >= 1
    # And requests still run: prefilled by the three prefill workers, decoded by the last one.
    with grpc.insecure_channel(mesh.router.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        out = [r for r in stub.Generate(request(stream_prompts(1, 7)[0], GREEDY), timeout=60)]
    assert sum(len(r.token_ids) for r in out) == MAX_TOKENS


def test_a_prefill_worker_finishes_its_prefills_before_it_serves_decode(
    mesh: Mesh, folder: str
) -> None:
    """A Prefill call whose KV push hangs (into a stalled link) is under way when its worker is
    switched to decode: the switch returns only once that call has ended, and counts it; Prefill
    calls after it are refused."""
    roles = _roles(mesh)
    worker = next(getattr(mesh, n) for n in ("b", "p") if roles[n] == "prefill")
    config = json.loads((Path(folder) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    proxy = TcpProxy(free_port())  # to nowhere; stalled, it holds every byte pushed into it
    proxy.stall()
    prompt = list(range(1, 65))  # four blocks
    target = worker_pb2.KVTarget(
        transport="tcp",
        transfer_id=secrets.token_hex(16),
        token=secrets.token_bytes(16),
        block_ids=range(4),
        block_size=16,
        endpoints=[worker_pb2.KVEndpoint(address=f"tcp://127.0.0.1:{proxy.port}", num_heads=heads)],
        timeout_ms=8000,
    )
    request = worker_pb2.PrefillRequest(
        request_id="held",
        prompt_token_ids=prompt,
        sampling=gen_pb.SamplingParams(),
        kv_target=target,
    )
    ended: list[tuple[float, grpc.StatusCode]] = []

    def prefill() -> None:
        with grpc.insecure_channel(worker.address) as ch:
            try:
                worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
        ended.append((time.monotonic(), code))

    try:
        call = threading.Thread(target=prefill)
        call.start()
        time.sleep(3)  # the prompt is computed in milliseconds; its push hangs
        assert not ended
        reply = mesh.set_role(worker, "decode")
        switched = time.monotonic()
        call.join()
    finally:
        proxy.close()
    (at, code) = ended[0]
    # The call's reply and the switch's travel on separate channels: the call's may be read a
    # fraction of a millisecond after the switch's (seen: 0.26 ms). A switch that did not wait
    # would return seconds before the call ends (its push times out 8 s after it began).
    assert at <= switched + 0.5
    assert code == grpc.StatusCode.UNAVAILABLE  # its push never got through
    assert (reply.role, reply.previous, reply.prefills_finished) == ("decode", "prefill", 1)
    with grpc.insecure_channel(worker.address) as ch, pytest.raises(grpc.RpcError) as info:
        worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "serves decode now" in info.value.details()
    wait_until(lambda: worker.stats().kv_blocks_used == 0, 10, "no block held")


def _check_outputs(folder: str, streams: list, prompts: list, kinds: list) -> None:
    """Each stream equals the same request run offline (all in one batch, as in the mesh)."""
    reference = LLM(folder, kv_cache_tokens=8192).generate(
        [{"prompt_token_ids": p} for p in prompts], [reference_params(k) for k in kinds]
    )
    for stream, prompt, kind, expected in zip(streams, prompts, kinds, reference, strict=True):
        (choice,) = expected.outputs
        assert [t for r in stream for t in r.token_ids] == choice.token_ids
        assert "".join(r.text for r in stream) == choice.text
        assert stream[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
        if kind is SHAPED:  # every token streamed has its logprobs once, across the moves
            assert sum(len(r.logprobs) for r in stream) == MAX_TOKENS
        usage = stream[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), MAX_TOKENS)
