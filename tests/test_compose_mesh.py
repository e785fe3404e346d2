"""The compose deployment, run as local processes (Docker cannot run here): its services' own
commands, variables and health checks serve requests; one request is one trace across router,
decode, prefill and the KV transfer, exported over OTLP; a real Prometheus scrapes every service
with the compose file's scrape config; the Grafana dashboard's queries name exported metrics and
run on that Prometheus.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from compose_local import (
    DEPLOY,
    LocalService,
    compose_config,
    free_port,
    healthy,
    plan,
    start,
    stop,
)
from otlp_receiver import OTLPReceiver, ReceivedSpan
from prometheus_local import Prometheus, prometheus_binary
from service_support import router_workers

from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdmesh.json"
# Default model: 30 layers x (K + V) x 16 tokens x 3 KV heads x 64 dims x 4 bytes per block.
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
READY_TIMEOUT_S = 240


@dataclass
class ComposeMesh:
    services: dict[str, LocalService]
    receiver: OTLPReceiver
    requests_sent: int = 0
    trace_ids: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.services["router"].address_of("PDMESH_PORT")

    def generate(
        self, request: gen_pb.GenerateRequest, metadata: tuple = ()
    ) -> list[gen_pb.GenerateResponse]:
        with grpc.insecure_channel(self.target) as ch:
            self.requests_sent += 1
            stub = generation_pb2_grpc.GenerationStub(ch)
            return list(stub.Generate(request, metadata=metadata, timeout=120))

    def metrics_text(self, name: str) -> str:
        s = self.services[name]
        var = (
            "PDMESH_METRICS_PORT" if "PDMESH_METRICS_PORT" in s.compose_env else "PDMESH_HTTP_PORT"
        )
        with urllib.request.urlopen(f"http://{s.address_of(var)}/metrics", timeout=10) as r:
            return r.read().decode()


@pytest.fixture(scope="module")
def mesh(default_model_folder: Path) -> Iterator[ComposeMesh]:
    receiver = OTLPReceiver()
    config = compose_config()
    services = plan(
        config,
        external={"jaeger:4317": receiver.endpoint},
        # Export spans within 0.1 s instead of 5 s, and keep the logs short.
        extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100", "PDMESH_LOG_LEVEL": "WARNING"},
    )
    assert set(services) == {"router", "prefill-0", "decode-0", "kvstore"}
    m = ComposeMesh(services, receiver)
    start(services)
    try:
        _wait_ready(m)
        yield m
    finally:
        stop(services)
        receiver.stop()
    for s in services.values():
        assert s.proc is not None and s.proc.returncode == 0, f"{s.name}:\n" + "".join(s.log[-30:])


def _wait_ready(m: ComposeMesh) -> None:
    """The router has linked both workers; then every compose health check passes."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while router_workers(m.target) != (1, 1):
        for s in m.services.values():
            if s.proc is not None and s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited:\n" + "".join(s.log[-40:]))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the compose mesh was not ready in {READY_TIMEOUT_S} s")
        time.sleep(0.5)
    for s in m.services.values():
        assert healthy(s), f"{s.name}: its compose health check failed"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _request(prompt: list[int], max_tokens: int, request_id: str = "") -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(
        request_id=request_id,
        token_ids=gen_pb.TokenIds(ids=prompt),
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0),
    )


# -- acceptance 2: the compose services serve ------------------------------------------------
def test_compose_services_answer_and_pass_their_health_checks(mesh: ComposeMesh) -> None:
    chat = gen_pb.ChatMessages(
        messages=[gen_pb.ChatMessage(role="user", content="What is the capital of France?")]
    )
    request = gen_pb.GenerateRequest(
        chat=chat, sampling=gen_pb.SamplingParams(max_tokens=32, temperature=0)
    )
    stream = mesh.generate(request)
    assert "Paris" in "".join(r.text for r in stream)
    assert stream[-1].finish_reason in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
    # A long prompt goes through the prefill worker and the KV data plane the file configures.
    long = mesh.generate(_request(_prompt(100, seed=1), 4))
    assert long[-1].timings.disaggregated
    assert sum(len(r.token_ids) for r in long) == 4
    for s in mesh.services.values():
        assert healthy(s), s.name


# -- acceptance 3: one request, one trace ----------------------------------------------------
def test_one_request_is_one_trace_across_router_decode_prefill_and_kv(mesh: ComposeMesh) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    rid = f"trace-{trace_id[:8]}"
    prompt = _prompt(100, seed=2)  # 7 blocks, past the 64-token threshold: a remote prefill
    stream = mesh.generate(
        _request(prompt, 6, rid), metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),)
    )
    assert stream[-1].timings.disaggregated
    expected = {
        "/pdmesh.v1.Generation/Generate",
        "router.request",
        "router.dispatch",
        "/pdmesh.v1.DecodeWorker/Submit",
        "decode.request",
        "decode.queue",
        "decode.prefill",
        "decode.generate",
        "kv.receive",
        "/pdmesh.v1.PrefillWorker/Prefill",
        "prefill.queue",
        "prefill.forward",
        "kv.send",
    }
    spans = mesh.receiver.wait_for(trace_id, lambda got: expected <= {s.name for s in got})
    # The KV store's part joins the trace too (the router's lookup, the prefill worker's
    # kvstore.lookup before it computes, the store's own spans); the rest is counted exactly.
    store = [
        s
        for s in spans
        if s.service == "pdmesh-kvstore" or "KVStore" in s.name or s.name.startswith("kvstore.")
    ]
    assert any(s.name == "kvstore.lookup" and s.service == "pdmesh-prefill" for s in store)
    spans = [s for s in spans if s not in store]
    names = {s.name for s in spans}
    assert expected <= names, f"missing {expected - names}"
    assert {s.service for s in spans} == {"pdmesh-router", "pdmesh-decode", "pdmesh-prefill"}
    # No span per token, and nothing from health checks or stats polls in the request's trace.
    assert len(spans) == 15, sorted(s.name for s in spans)

    by_id = {s.span_id: s for s in spans}

    def one(name: str, service: str) -> ReceivedSpan:
        found = [s for s in spans if s.name == name and s.service == service]
        assert len(found) == 1, (name, service, found)
        return found[0]

    def parent_of(span: ReceivedSpan) -> ReceivedSpan:
        assert span.parent_id in by_id, f"{span.name}'s parent is not in the trace"
        return by_id[span.parent_id]

    # Every span but the client's root hangs off another span of this trace.
    generate = one("/pdmesh.v1.Generation/Generate", "pdmesh-router")
    assert generate.parent_id == parent
    assert all(s.parent_id in by_id for s in spans if s is not generate)
    router_request = one("router.request", "pdmesh-router")
    decode_request = one("decode.request", "pdmesh-decode")
    submit_server = one("/pdmesh.v1.DecodeWorker/Submit", "pdmesh-decode")
    prefill_server = one("/pdmesh.v1.PrefillWorker/Prefill", "pdmesh-prefill")
    receive = one("kv.receive", "pdmesh-decode")
    assert parent_of(router_request) is generate
    assert parent_of(one("router.dispatch", "pdmesh-router")) is router_request
    assert parent_of(decode_request) is submit_server
    assert parent_of(receive) is decode_request
    assert parent_of(one("kv.send", "pdmesh-prefill")) is receive
    assert parent_of(one("prefill.forward", "pdmesh-prefill")) is prefill_server
    assert parent_of(one("prefill.queue", "pdmesh-prefill")) is prefill_server
    for phase in ("decode.queue", "decode.prefill", "decode.generate"):
        assert parent_of(one(phase, "pdmesh-decode")) is decode_request
    submit_client = parent_of(submit_server)
    assert (submit_client.service, parent_of(submit_client).name) == (
        "pdmesh-router",
        "router.request",
    )
    prefill_client = parent_of(prefill_server)
    assert (prefill_client.service, parent_of(prefill_client).name) == (
        "pdmesh-decode",
        "decode.request",
    )

    dispatch = one("router.dispatch", "pdmesh-router").attributes
    assert dispatch["pdmesh.dispatch.outcome"] == "remote_prefill"
    assert dispatch["pdmesh.prefill_worker"] and dispatch["pdmesh.decode_worker"]
    assert "least KV usage" in dispatch["pdmesh.dispatch.reason"]
    kv_bytes = 7 * BLOCK_BYTES
    send = one("kv.send", "pdmesh-prefill")
    for kv in (send, receive):
        assert kv.attributes["pdmesh.kv.bytes"] == kv_bytes
        assert kv.attributes["pdmesh.kv.layers"] == 30
        assert kv.attributes["pdmesh.kv.blocks"] == 7
        assert kv.attributes["pdmesh.kv.seconds"] > 0
    assert send.attributes["pdmesh.kv.transfer_id"] == receive.attributes["pdmesh.kv.transfer_id"]
    assert prefill_server.span_id in send.links
    generate_summary = one("decode.generate", "pdmesh-decode").attributes
    assert generate_summary["pdmesh.completion_tokens"] == 6
    assert decode_request.attributes["pdmesh.request_id"] == rid
    assert router_request.attributes["pdmesh.request_id"] == rid
    assert not any(s.error for s in spans)


# -- acceptance 4 and 5: Prometheus and the dashboard ----------------------------------------
@pytest.fixture(scope="module")
def prometheus(mesh: ComposeMesh) -> Iterator[Prometheus]:
    """A real Prometheus with deploy/prometheus/prometheus.yml, targets mapped to loopback."""
    binary = prometheus_binary()
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [_local_target(mesh, t) for t in static["targets"]]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        p = Prometheus(f"http://127.0.0.1:{port}", proc)
        try:
            p.wait_ready(n_targets=sum(len(s["targets"]) for j in config["scrape_configs"]
                                              for s in j["static_configs"]))  # fmt: skip
            yield p
        finally:
            proc.terminate()
            proc.wait(20)


def _local_target(mesh: ComposeMesh, target: str) -> str:
    host, port = target.rsplit(":", 1)
    assert host in mesh.services, f"prometheus.yml scrapes {target}: no such pdmesh service"
    return mesh.services[host].local(int(port))


def test_prometheus_counts_one_ttft_observation_per_request(
    mesh: ComposeMesh, prometheus: Prometheus
) -> None:
    for i in range(3):
        mesh.generate(_request(_prompt(20 + 50 * i, seed=10 + i), 3))
    sent = mesh.requests_sent
    ttft = "sum(pdmesh_time_to_first_token_seconds_count)"
    assert prometheus.wait_value(ttft, sent) == sent
    dispatched = "sum(pdmesh_router_dispatch_decisions_total)"
    assert prometheus.wait_value(dispatched, sent) == sent
    router_ttft = 'sum(pdmesh_router_time_to_first_token_seconds_count{endpoint="grpc"})'
    assert prometheus.wait_value(router_ttft, sent) == sent
    answered = 'sum(pdmesh_router_requests_total{endpoint="grpc",status="OK"})'
    assert prometheus.wait_value(answered, sent) == sent
    tokens = 'sum(pdmesh_requests_finished_total{finish_reason=~"stop|length"})'
    assert prometheus.wait_value(tokens, sent) == sent
    assert prometheus.value('pdmesh_kv_blocks_total{role="decode"}') == 16384 / 16
    # The prefill's and the decode's counters are scraped at different moments.
    sent_bytes, received = prometheus.wait_equal(
        'sum(pdmesh_kv_transfer_bytes_total{direction="send"})',
        'sum(pdmesh_kv_transfer_bytes_total{direction="receive"})',
    )
    assert sent_bytes and sent_bytes == received
    assert prometheus.value("sum(pdmesh_kv_transfers_total)") > 0


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def _exported_names(text: str) -> set[str]:
    """Every sample name a /metrics page carries or declares (a histogram with no samples yet
    still has its _bucket, _count and _sum)."""
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names.update(name + s for s in ("_bucket", "_count", "_sum"))
    return names


def test_dashboard_queries_name_exported_metrics_and_run(
    mesh: ComposeMesh, prometheus: Prometheus
) -> None:
    exported = set().union(*(_exported_names(mesh.metrics_text(n)) for n in mesh.services))
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    for title, expr in exprs:
        metrics = set(re.findall(r"\bpdmesh_[a-z0-9_]+\b", expr))
        assert metrics, f"panel {title!r} queries no pdmesh metric: {expr}"
        assert metrics <= exported, f"panel {title!r}: {sorted(metrics - exported)} not exported"
        # Grafana's interval variables, as Grafana would fill them in.
        prometheus.query(expr.replace("$__rate_interval", "1m"))
