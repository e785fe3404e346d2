"""Faults between the router, a prefill worker and decode workers, each a process of its own: the
KV link stalled or cut mid-transfer (through a proxy), the prefill worker killed mid-transfer, a
deadline during a transfer, the `fail` policy, hostile frames at a live decode worker, and the
router restarted. Every outcome is checked against the offline engine, and no block may leak."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import zmq
from mesh_support import free_port
from service_support import Service, wait_until, wait_workers
from tcp_proxy import TcpProxy

from pdmesh import LLM, SamplingParams
from pdmesh.kv_transfer import FrameHeader
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(120)

PARAMS = dict(max_tokens=8, temperature=0, ignore_eos=True)
TIMEOUT_S = 4.0  # the decode workers' --prefill-timeout: how long a stalled transfer may take


@dataclass
class Cluster:
    router: Service
    prefill: Service
    decode: Service  # KV arrives through `proxy`; policy recompute
    strict: Service  # policy fail; driven directly, in no router's rotation
    proxy: TcpProxy
    kv_port: int
    reference: LLM


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = str(tiny_model("llama"))
    logs = tmp_path_factory.mktemp("logs")
    engine = ["--model", folder, "--kv-cache-tokens", "4096"]
    kv_port = free_port()
    proxy = TcpProxy(kv_port)
    decode_flags = ["--prefill-timeout", str(TIMEOUT_S), "--kv-timeout", "2", *engine]
    prefill = Service("prefill", ["--port", str(free_port()), *engine], logs / "prefill.log")
    decode = Service(
        "decode",
        [
            "--port",
            str(free_port()),
            "--kv-port",
            str(kv_port),
            "--kv-advertise",
            f"127.0.0.1:{proxy.port}",  # prefill workers push through the proxy
            *decode_flags,
        ],
        logs / "decode.log",
    )
    strict = Service(
        "decode",
        ["--port", str(free_port()), "--prefill-failure-policy", "fail", *decode_flags],
        logs / "strict.log",
    )
    router = Service(
        "router",
        [
            "--port",
            str(free_port()),
            "--http-port",
            "0",
            "--prefill",
            prefill.address,
            "--decode",
            decode.address,
            "--disagg-min-tokens",
            "16",
            "--model",
            folder,
        ],
        logs / "router.log",
    )
    services = [prefill, decode, strict, router]
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_serving()
        wait_workers(router.address, 1, 1)
        c = Cluster(
            router, prefill, decode, strict, proxy, kv_port, LLM(folder, kv_cache_tokens=4096)
        )
        # Through the proxy once: the transfer path works, and its connection stays open.
        assert _generate(c, _prompt(0))[-1].timings.disaggregated
        yield c
    finally:
        for s in services:
            s.stop()
        proxy.close()


def _prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + i * 104729) % 512 for i in range(n)]


def _generate(c: Cluster, prompt: list[int], timeout: float = 60) -> list[gen_pb.GenerateResponse]:
    with grpc.insecure_channel(c.router.address) as ch:
        req = gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(**PARAMS)
        )
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout))


def _expected(c: Cluster, prompt: list[int]) -> list[int]:
    out = c.reference.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS))
    return out[0].outputs[0].token_ids


def _tokens(stream: list[gen_pb.GenerateResponse]) -> list[int]:
    return [t for r in stream for t in r.token_ids]


def _start_in_background(c: Cluster, prompt: list[int]) -> tuple[threading.Thread, list]:
    """Generate on a thread; returns once the decode worker holds blocks for the prompt and the
    prefill worker had time to push into the stalled link."""
    result: list[list[gen_pb.GenerateResponse]] = []
    worker = threading.Thread(target=lambda: result.append(_generate(c, prompt)))
    worker.start()
    wait_until(lambda: c.decode.stats().kv_blocks_used > 0, 10, "blocks reserved for the KV")
    time.sleep(0.3)  # a tiny model's prefill takes milliseconds: its frames are on the way
    return worker, result


def _no_blocks_held(c: Cluster) -> None:
    def free() -> bool:
        return c.decode.stats().kv_blocks_used == 0 and c.prefill.stats().kv_blocks_used == 0

    wait_until(free, 5, "every KV block is free on both workers")


@pytest.fixture
def healed(cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.proxy.heal()


@pytest.mark.parametrize("fault", ["stall", "cut"])
def test_a_broken_kv_link_times_out_and_the_decode_worker_recomputes(
    healed: Cluster, fault: str
) -> None:
    c = healed
    prompt = _prompt(1 if fault == "stall" else 2)
    before = c.decode.stats()
    c.proxy.stall()  # the transfer starts, and stops mid-way
    started = time.monotonic()
    worker, result = _start_in_background(c, prompt)
    if fault == "cut":
        c.proxy.cut()
    worker.join(30)
    assert time.monotonic() - started >= TIMEOUT_S * 0.9  # it waited for the policy's timeout
    assert _tokens(result[0]) == _expected(c, prompt)
    after = c.decode.stats()
    assert after.prefill_fallbacks - before.prefill_fallbacks == 1
    assert not result[0][-1].timings.disaggregated
    _no_blocks_held(c)


def test_deadline_during_a_stalled_transfer_frees_both_workers(healed: Cluster) -> None:
    c = healed
    c.proxy.stall()
    with pytest.raises(grpc.RpcError) as err:
        _generate(c, _prompt(3), timeout=1.0)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The deadline reached the prefill worker with the Prefill call: its blocks go too.
    _no_blocks_held(c)


def test_a_killed_prefill_worker_falls_back_and_rejoins_when_restarted(healed: Cluster) -> None:
    c = healed
    prompt = _prompt(4)
    before = c.decode.stats()
    c.proxy.stall()  # holds the prefill worker mid-transfer
    worker, result = _start_in_background(c, prompt)
    killed = time.monotonic()
    c.prefill.kill()
    worker.join(30)
    # The Prefill call failed at once (no wait for the timeout); the decode worker recomputed.
    assert time.monotonic() - killed < TIMEOUT_S
    assert _tokens(result[0]) == _expected(c, prompt)
    assert c.decode.stats().prefill_fallbacks - before.prefill_fallbacks == 1
    wait_until(lambda: c.decode.stats().kv_blocks_used == 0, 5, "decode blocks are free")

    c.proxy.heal()
    wait_workers(c.router.address, 0, 1)  # out of the rotation
    c.prefill.start().wait_serving()
    wait_workers(c.router.address, 1, 1)  # back, through health checks
    prompt = _prompt(5)
    stream = _generate(c, prompt)
    assert _tokens(stream) == _expected(c, prompt)
    assert stream[-1].timings.disaggregated
    _no_blocks_held(c)


def test_the_fail_policy_ends_the_request_unavailable(cluster: Cluster) -> None:
    """A decode worker driven as the router drives it, told to use a prefill worker that is
    not there."""
    with grpc.insecure_channel(cluster.strict.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        updates = stub.Subscribe(worker_pb2.SubscribeRequest(subscriber_id="test"))
        next(updates)  # the handshake
        stub.Submit(
            worker_pb2.DecodeRequest(
                request_id="strict-1",
                subscriber_id="test",
                prompt_token_ids=_prompt(6),
                sampling=gen_pb.SamplingParams(**PARAMS),
                prefill_address=f"127.0.0.1:{free_port()}",  # nobody listens
                disagg_min_tokens=16,
            ),
            timeout=10,
        )
        delta = next(d for u in updates for d in u.deltas if d.request_id == "strict-1")
        updates.cancel()
    assert delta.error_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "prefill failed" in delta.error_message and not delta.token_ids
    wait_until(lambda: cluster.strict.stats().kv_blocks_used == 0, 5, "blocks are free")


def test_hostile_frames_at_a_live_decode_worker_are_dropped_and_counted(
    cluster: Cluster,
) -> None:
    c = cluster
    before = c.decode.stats().kv_frames_dropped
    unknown = FrameHeader(
        transfer_id=secrets.token_bytes(16),
        token=secrets.token_bytes(16),
        layer=0,
        first_block=0,
        num_blocks=1,
        head_start=0,
        num_heads=2,
        block_size=16,
        head_dim=16,
        dtype_code=1,
        payload_nbytes=4,
    )
    frames = [
        [unknown.pack(), b"\0" * 4],  # a transfer nobody announced
        [secrets.token_bytes(75)],  # garbage
        [b""],
        [unknown.pack()[:-5], b"\0" * 4],  # truncated header
    ]
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{c.kv_port}")  # straight to its KV port, past the proxy
    for parts in frames * 5:
        sock.send_multipart(parts)
    want = before + len(frames) * 5
    wait_until(lambda: c.decode.stats().kv_frames_dropped == want, 5, "every frame dropped")
    sock.close()
    context.term()
    assert c.decode.serving()
    prompt = _prompt(7)
    stream = _generate(c, prompt)  # the data plane still carries real transfers
    assert _tokens(stream) == _expected(c, prompt) and stream[-1].timings.disaggregated


def test_a_restarted_router_finds_its_workers(cluster: Cluster) -> None:
    c = cluster
    c.router.kill()
    c.router.start().wait_serving()
    wait_workers(c.router.address, 1, 1)
    prompt = _prompt(8)
    stream = _generate(c, prompt)
    assert _tokens(stream) == _expected(c, prompt) and stream[-1].timings.disaggregated
    _no_blocks_held(c)
