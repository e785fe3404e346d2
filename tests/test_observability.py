"""pdmesh.observability on its own: the hot-path histogram against prometheus_client's, tracing
off unless OTEL_* asks (and then exporting real spans), and `pdmesh healthcheck`."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdmesh import envs
from pdmesh.observability import tracing
from pdmesh.observability.histogram import ITL_BUCKETS_S, FastHistogram

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.fixture
def no_otel(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _samples(registry: CollectorRegistry) -> list[str]:
    return [
        line
        for line in generate_latest(registry).decode().splitlines()
        if not line.startswith("#") and "_created" not in line
    ]


def test_fast_histogram_exports_what_prometheus_client_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("itl_seconds", "d", ITL_BUCKETS_S)
    ours.register(fast)
    reference = Histogram("itl_seconds", "d", buckets=ITL_BUCKETS_S, registry=theirs)
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.001, 0.05, 2.5, 99.0]) or rng.random() for _ in range(500)]
    for v in values:
        reference.observe(v)
    for v in values:
        fast.observe(v)
    assert _samples(ours) == _samples(theirs)
    assert fast.count == 500


def test_fast_histogram_weighted_observation() -> None:
    registry = CollectorRegistry()
    fast = FastHistogram("gap_seconds", "d", (0.01, 0.1), {"direction": "send"})
    registry.register(fast)
    fast.observe(0.05, 3)
    text = generate_latest(registry).decode()
    assert 'gap_seconds_bucket{direction="send",le="0.01"} 0.0' in text
    assert 'gap_seconds_bucket{direction="send",le="0.1"} 3.0' in text
    assert 'gap_seconds_count{direction="send"} 3.0' in text
    with pytest.raises(ValueError, match="increasing"):
        FastHistogram("bad", "d", (0.1, 0.01))


def test_tracing_is_off_and_free_unless_otel_says_where(no_otel: pytest.MonkeyPatch) -> None:
    assert envs.otel_traces_exporters() == ()
    assert tracing.setup("pdmesh-test") is False
    assert not tracing.enabled()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    assert tracing.inject() == {}
    no_otel.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert envs.otel_traces_exporters() == ("otlp",)
    no_otel.setenv("OTEL_TRACES_EXPORTER", "none")
    assert envs.otel_traces_exporters() == ()
    no_otel.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    assert envs.otel_traces_exporters() == ("otlp", "console")
    no_otel.setenv("OTEL_SDK_DISABLED", "true")
    assert envs.otel_traces_exporters() == ()
    no_otel.delenv("OTEL_SDK_DISABLED")
    no_otel.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        envs.otel_traces_exporters()
    no_otel.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        envs.otel_otlp_traces_protocol()


def test_tracing_on_exports_spans_with_the_service_name() -> None:
    # A subprocess: tracing state is per process, as in a service.
    code = (
        "from pdmesh.observability import tracing\n"
        "assert tracing.setup('pdmesh-test')\n"
        "assert len(tracing.server_interceptors()) == 1 and tracing.client_interceptors()\n"
        "parent = tracing.start_span('parent')\n"
        "carrier = tracing.inject(parent)\n"
        "child = tracing.record_span('child', 1, 2, tracing.extract(carrier))\n"
        "assert child.parent.span_id == parent.get_span_context().span_id\n"
        "tracing.end_span(parent)\n"
        "tracing.shutdown()\n"
    )
    env = {"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "console"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"service.name": "pdmesh-test"') == 2
    assert '"name": "child"' in out.stdout


def test_healthcheck_exits_2_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the check: nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "healthcheck", f"127.0.0.1:{port}", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "UNAVAILABLE" in out.stderr
