"""The KV transport is chosen per (prefill worker, decode worker) pair: one decode worker (TP=2)
pushed to over tcp by one prefill worker and over gloo by another, each process of its own. The
tokens match the offline engine, every byte is counted under its transport on both ends, and a
prefill worker refuses a transport it cannot serve with INVALID_ARGUMENT and stays healthy."""

from __future__ import annotations

import secrets
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from mesh_support import free_port
from prometheus_client.parser import text_string_to_metric_families
from service_support import Service, decode_via, wait_until

from pdmesh import LLM, SamplingParams
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(180)

PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)


@dataclass
class Pairs:
    tcp: Service  # prefill worker the decode worker reaches over tcp (its default)
    gloo: Service  # prefill worker named by --kv-transport-for ...=gloo
    decode: Service
    metrics: dict[str, int]  # role name -> /metrics port
    reference: LLM


def _metrics_port(service: Service) -> int:
    return int(service.argv[service.argv.index("--metrics-port") + 1])


@pytest.fixture(scope="module")
def pairs(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pairs]:
    folder = str(tiny_model("llama"))
    logs = tmp_path_factory.mktemp("logs")
    engine = ["--model", folder, "--kv-cache-tokens", "4096"]

    def prefill(name: str) -> Service:
        argv = ["--port", str(free_port()), "--metrics-port", str(free_port()), *engine]
        return Service("prefill", argv, logs / f"{name}.log")

    tcp, gloo = prefill("prefill-tcp"), prefill("prefill-gloo")
    decode = Service(
        "decode",
        [
            "--port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
            "--tensor-parallel-size",
            "2",
            "--kv-transport",
            "tcp",
            "--kv-transport-for",
            f"{gloo.address}=gloo",
            *engine,
        ],
        logs / "decode.log",
    )
    services = [tcp, gloo, decode]
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_serving()
        ports = {"tcp": _metrics_port(tcp), "gloo": _metrics_port(gloo)}
        ports["decode"] = _metrics_port(decode)
        yield Pairs(tcp, gloo, decode, ports, LLM(folder, kv_cache_tokens=4096))
    finally:
        for s in services:
            s.stop()


def _prompt(seed: int, n: int = 80) -> list[int]:
    return [(seed * 7919 + i * 104729) % 512 for i in range(n)]


def _kv_bytes(port: int) -> dict[tuple[str, str], float]:
    """(direction, transport) -> pdmesh_kv_transfer_bytes_total from a worker's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pdmesh_kv_transfer_bytes":
            for s in family.samples:
                out[(s.labels["direction"], s.labels["transport"])] = s.value
    return out


def test_each_pair_moves_kv_over_its_own_transport(pairs: Pairs) -> None:
    prompts = {"tcp": _prompt(1), "gloo": _prompt(2)}
    expected = {
        name: o.outputs[0].token_ids
        for name, o in zip(
            prompts,
            pairs.reference.generate(
                [{"prompt_token_ids": p} for p in prompts.values()], SamplingParams(**PARAMS)
            ),
            strict=True,
        )
    }
    for name, prefill in (("tcp", pairs.tcp), ("gloo", pairs.gloo)):
        got = decode_via(pairs.decode, prefill, f"via-{name}", prompts[name], PARAMS)
        assert got == expected[name]

    d = pairs.decode.stats()
    assert d.remote_prefills == 2 and d.prefill_fallbacks == 0
    sent = {name: _kv_bytes(pairs.metrics[name]) for name in ("tcp", "gloo")}
    received = _kv_bytes(pairs.metrics["decode"])
    # Each prefill worker pushed over one transport only: the one its pair was given.
    assert set(sent["tcp"]) == {("send", "tcp")} and set(sent["gloo"]) == {("send", "gloo")}
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K+V) x tokens x KV heads x dims x fp32
    for name in ("tcp", "gloo"):
        pushed = -(-len(prompts[name]) // 16) * block_bytes
        assert sent[name][("send", name)] == pushed
        # rank 0's heads; the follower's half is in GetStats' total
        assert received[("receive", name)] == pushed / 2
    assert d.kv_bytes_received == sum(len(p) for p in prompts.values()) // 16 * block_bytes
    wait_until(lambda: pairs.decode.stats().kv_blocks_used == 0, 5, "blocks are free")


@pytest.mark.parametrize(
    ("transport", "message"),
    [
        ("nccl", "kv_target.transport: the nccl KV transport moves caches on cuda"),
        ("rdma", "kv_target.transport: unknown KV transport 'rdma'; available: gloo, nccl, tcp"),
    ],
)
def test_a_transport_the_prefill_worker_cannot_serve_is_refused(
    pairs: Pairs, transport: str, message: str
) -> None:
    target = worker_pb2.KVTarget(
        transport=transport,
        transfer_id=secrets.token_hex(16),
        token=secrets.token_bytes(16),
        first_block=0,
        block_ids=list(range(5)),
        block_size=16,
        endpoints=[worker_pb2.KVEndpoint(address="tcp://127.0.0.1:1", head_start=0, num_heads=2)],
        timeout_ms=5000,
    )
    request = worker_pb2.PrefillRequest(
        request_id="refused",
        prompt_token_ids=_prompt(3),
        sampling=gen_pb.SamplingParams(**PARAMS),
        kv_target=target,
    )
    with grpc.insecure_channel(pairs.tcp.address) as ch, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    assert pairs.tcp.serving() and pairs.tcp.stats().kv_blocks_used == 0


def test_a_decode_worker_refuses_a_transport_its_cache_cannot_use(
    tiny_model, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("bad") / "decode.log"
    argv = ["--port", str(free_port()), "--model", str(tiny_model("llama"))]
    bad = Service("decode", [*argv, "--kv-transport-for", "127.0.0.1:1=nccl"], log).start()
    assert bad.proc is not None and bad.proc.wait(120) != 0
    assert "the nccl KV transport moves caches on cuda; this worker's cache is on cpu" in (
        log.read_text()
    )


def test_a_prefix_cached_on_the_prefill_worker_is_pushed_whole(tiny_model, pairs: Pairs) -> None:
    """The prefill worker holds a prompt's first 64 tokens in its prefix cache (an earlier
    Prefill call pushed that prompt to a receiver of this test); the decode worker does not. The
    cached blocks go every layer at once (`send_layers`) to both decode ranks, the rest layer by
    layer: the tokens match the offline engine and each block is sent exactly once."""
    import torch

    from pdmesh.kv_transfer import PageGeometry, TransferSpec, create_receiver

    geo = PageGeometry(
        num_layers=2, block_size=16, num_kv_heads=2, head_start=0, head_dim=16, dtype=torch.float32
    )
    warm = _prompt(4)  # 5 blocks
    rx = create_receiver("gloo", torch.zeros(geo.cache_shape(8)), geo, "tcp://127.0.0.1:0")
    try:
        spec = TransferSpec.new(list(range(5)), 0, 2)
        done = rx.expect(spec, timeout=60)
        target = worker_pb2.KVTarget(
            transport="gloo",
            transfer_id=spec.transfer_id,
            token=spec.token,
            first_block=0,
            block_ids=spec.block_ids,
            block_size=16,
            endpoints=[worker_pb2.KVEndpoint(address=rx.endpoint, head_start=0, num_heads=2)],
            timeout_ms=30000,
        )
        with grpc.insecure_channel(pairs.gloo.address) as ch:
            worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="warm",
                    prompt_token_ids=warm,
                    sampling=gen_pb.SamplingParams(**PARAMS),
                    kv_target=target,
                ),
                timeout=60,
            )
        done.result(timeout=30)
    finally:
        rx.close()
    prompt = warm[:64] + _prompt(5, 30)  # 6 blocks, the first 4 cached on the prefill worker
    expected = (
        pairs.reference.generate([{"prompt_token_ids": prompt}], SamplingParams(**PARAMS))[0]
        .outputs[0]
        .token_ids
    )
    hits = pairs.gloo.stats().prefix_hit_tokens
    sent = _kv_bytes(pairs.metrics["gloo"])[("send", "gloo")]
    received = pairs.decode.stats().kv_bytes_received
    assert decode_via(pairs.decode, pairs.gloo, "cached-there", prompt, PARAMS) == expected
    assert pairs.gloo.stats().prefix_hit_tokens - hits == 64
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    assert _kv_bytes(pairs.metrics["gloo"])[("send", "gloo")] - sent == 6 * block_bytes
    assert pairs.decode.stats().kv_bytes_received - received == 6 * block_bytes
    wait_until(lambda: pairs.decode.stats().kv_blocks_used == 0, 5, "blocks are free")
