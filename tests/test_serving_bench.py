"""The benchmark tooling on real processes: token sources feeding a real router, the relay
driver's counts over gRPC and over the gateway's SSE, and `pdmesh bench --target` end to end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.bench.relay import RelayConfig, drive, start_processes
from pdmesh.mesh import wait_for_workers
from pdmesh.supervisor import Child, stop_all

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def relay_mesh() -> Iterator[tuple[str, str, list[Child]]]:
    """Two token sources and a router (with its HTTP gateway) in front of them."""
    children, target, http = start_processes(RelayConfig(sources=2, http=True))
    try:
        wait_for_workers(target, 0, 2, children, 120)
        yield target, http, children
    finally:
        stop_all(children)


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "sse"])
def test_relay_streams_exact_lengths(relay_mesh: tuple[str, str, list[Child]], http: bool) -> None:
    target, url, children = relay_mesh
    cfg = RelayConfig(
        clients=16, sources=2, output_len=64, duration_s=2.0, warmup_s=0.5, idle_s=0.5, http=http
    )
    pids = {c.name: c.proc.pid for c in children} | {"clients": os.getpid()}
    result = asyncio.run(drive(cfg, target, url, pids))
    # Every finished stream had exactly 64 tokens, finish_reason LENGTH and matching usage.
    assert result.errors == 0 and result.bad_finishes == 0
    assert result.edge == ("http" if http else "grpc")
    assert result.router_cpu_us_per_token > 0
    assert result.requests_per_s > 0
    # Whole requests dominate the window: tokens/s is about requests/s x 64.
    assert result.tokens_per_s > 0.5 * result.requests_per_s * 64
    assert result.messages_per_s > 0 and result.tokens_per_message >= 1
    assert set(result.cpu_cores_used) == {
        "source-0",
        "source-1",
        "router",
        "clients",
        "total",
        "other_processes",
    }


def test_serving_bench_cli_writes_its_figures(
    relay_mesh: tuple[str, str, list[Child]], tmp_path: Path
) -> None:
    target, _, _ = relay_mesh
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "pdmesh.cli", "bench", "--target", target,
            "--num-requests", "12", "--input-len", "32", "--output-len", "20",
            "--range-ratio", "0.5", "--request-rate", "40", "--concurrency", "6",
            "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500",
            "--json-out", str(out), "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert "wrong_output_lengths" not in result
    assert 12 * 10 <= result["total_output_tokens"] <= 12 * 30
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[name]) == {"mean", "p50", "p90", "p99"}
        assert result[name]["p50"] <= result[name]["p99"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["goodput"] == pytest.approx(result["request_throughput"], rel=0.01)
    assert result["good_requests"] == 12


def test_an_inter_token_slo_counts_each_requests_own_stalls() -> None:
    """A stream whose mean pace meets a TPOT bound but that stalls twice in 100 tokens fails a
    p99 ITL bound; an even stream at the same mean pace meets both."""
    from pdmesh.bench.latency_stats import RequestRecord, Slo, summarize

    def stream(gaps_ms: list[float]) -> RequestRecord:
        r, t = RequestRecord(prompt_len=8, expected_output_len=len(gaps_ms) + 1), 0.1
        r.on_message(t, 1, None)
        for gap in gaps_ms:
            r.on_message(t + gap / 1e3, 1, t)
            t += gap / 1e3
        r.latency_s = t
        return r

    even, stalled = stream([20.0] * 100), stream([10.0] * 98 + [510.0] * 2)
    slo = Slo(ttft_ms=1000, tpot_ms=40, itl_p99_ms=25)
    assert Slo(ttft_ms=1000, tpot_ms=40).met(stalled)  # its mean: 20 ms a token
    assert slo.met(even) and not slo.met(stalled)
    assert summarize([even, stalled], 1.0, slo)["good_requests"] == 1
    with pytest.raises(ValueError, match="itl_p99_ms"):
        Slo(itl_p99_ms=0)
