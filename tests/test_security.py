"""A mesh with mutual TLS on every gRPC hop and API keys on the public API (`pdmesh up` passing
the flags through): what gets in, what does not, and that every service listens only where it
was told to."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import Pki, make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from mesh_support import Mesh, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.healthcheck import check
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(300)

KEY = "test-key-0123456789"
PROMPT = list(range(100, 160))  # long enough to be prefilled on the prefill worker
PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def folder(tiny_model) -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def mesh(folder: str, pki: Pki) -> Iterator[Mesh]:
    m = start_mesh(
        "--model",
        folder,
        "--kv-cache-tokens",
        "4096",
        "--disagg-min-tokens",
        "16",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-ca",
        str(pki.ca),
        "--public-client-auth",
        "--api-keys",
        f"another-key-abcdef,{KEY}",
        http=True,
    )
    try:
        yield m
    finally:
        m.stop()


def _tls(pki: Pki, cert: Path | None, key: Path | None) -> TLSConfig:
    return TLSConfig(str(cert) if cert else None, str(key) if key else None, str(pki.ca))


def _channel(address: str, tls: TLSConfig | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials())


def _generate(channel: grpc.Channel, metadata: tuple = ()) -> list[gen_pb.GenerateResponse]:
    req = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=PROMPT), sampling=gen_pb.SamplingParams(**PARAMS)
    )
    stub = generation_pb2_grpc.GenerationStub(channel)
    return list(stub.Generate(req, timeout=30, metadata=metadata))


def _refused(address: str, tls: TLSConfig | None, metadata: tuple = ()) -> grpc.StatusCode:
    with _channel(address, tls) as ch, pytest.raises(grpc.RpcError) as err:
        _generate(ch, metadata)
    return err.value.code()


def test_the_public_grpc_api_needs_a_client_certificate_and_a_key(
    mesh: Mesh, pki: Pki, folder: str
) -> None:
    client = _tls(pki, pki.client_cert, pki.client_key)
    bearer = (("authorization", f"Bearer {KEY}"),)
    assert _refused(mesh.target, None, bearer) is grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _refused(mesh.target, _tls(pki, None, None), bearer) is grpc.StatusCode.UNAVAILABLE
    rogue = _tls(pki, pki.rogue_cert, pki.rogue_key)
    assert _refused(mesh.target, rogue, bearer) is grpc.StatusCode.UNAVAILABLE
    wrong = (("authorization", "Bearer wrong-key-000000"),)
    for metadata in ((), wrong, (("authorization", KEY),)):  # none, wrong, not "Bearer"
        assert _refused(mesh.target, client, metadata) is grpc.StatusCode.UNAUTHENTICATED
    with _channel(mesh.target, client) as ch:
        stream = _generate(ch, bearer)
        # Health needs no key (probes); reflection does.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(ch).get_services()
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(gen_pb.ModelInfoRequest(), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(gen_pb.ModelInfoRequest(), timeout=5, metadata=bearer).name
    expected = LLM(folder, kv_cache_tokens=4096).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(**PARAMS)
    )
    assert [t for r in stream for t in r.token_ids] == expected[0].outputs[0].token_ids
    # Prefilled on the prefill worker: router -> decode -> prefill all spoke mutual TLS.
    assert stream[-1].timings.disaggregated
    assert check(mesh.target, tls=client)[0] == 0  # `pdmesh healthcheck --tls-*`


def test_workers_accept_only_mutual_tls_from_the_mesh_ca(mesh: Mesh, pki: Pki) -> None:
    client = _tls(pki, pki.client_cert, pki.client_key)
    for address in mesh.decode + mesh.prefill:
        stub_cls = (
            worker_pb2_grpc.DecodeWorkerStub
            if address in mesh.decode
            else worker_pb2_grpc.PrefillWorkerStub
        )
        for tls in (None, _tls(pki, None, None), _tls(pki, pki.rogue_cert, pki.rogue_key)):
            with _channel(address, tls) as ch, pytest.raises(grpc.RpcError) as err:
                stub_cls(ch).GetStats(worker_pb2.StatsRequest(), timeout=5)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        with _channel(address, client) as ch:
            assert stub_cls(ch).GetStats(worker_pb2.StatsRequest(), timeout=5).kv_blocks_total


def _https(mesh: Mesh, pki: Pki, path: str, key: str | None, body: dict | None = None):
    assert mesh.http is not None
    url = mesh.http.replace("http://", "https://") + path
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_the_https_gateway_needs_a_key_except_for_health(mesh: Mesh, pki: Pki) -> None:
    status, headers, body = _https(mesh, pki, "/v1/models", None)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert _https(mesh, pki, "/v1/models", "wrong-key-000000")[0] == 401
    assert _https(mesh, pki, "/v1/models", KEY)[0] == 200
    assert _https(mesh, pki, "/health", None)[0] == 200
    status, _, body = _https(
        mesh, pki, "/v1/completions", KEY, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is not served
        assert mesh.http is not None
        urllib.request.urlopen(mesh.http + "/health", timeout=10)


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp shows them) of the TCP sockets `pid` listens
    on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


def test_every_service_listens_only_on_the_configured_host(mesh: Mesh) -> None:
    # 127.0.0.1 as /proc/net/tcp spells it, and as IPv4-mapped IPv6 (::ffff:127.0.0.1).
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    for pid in mesh.pids.values():
        addresses = _listening(pid)
        # gRPC, metrics and (decode) the KV data plane; the router's gRPC and HTTP.
        assert len(addresses) >= 2, addresses
        assert set(addresses) <= loopback, (pid, addresses)
