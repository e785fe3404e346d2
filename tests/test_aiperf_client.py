"""`pdmesh bench --serve --client aiperf` reads AIPerf's export (a real one, trimmed to the
fields it reads: AIPerf 0.13.0 against `pdmesh up --colocated` on the 2-core CPU machine) into
the figures `vllm bench serve` reports, and runs AIPerf with the bench's workload."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdmesh.bench.aiperf_client import aiperf_argv, aiperf_figures
from pdmesh.bench.serve_peer import METRICS

EXPORT = Path(__file__).parent / "data" / "aiperf_export.json"


def test_the_export_becomes_vllm_bench_serve_figures() -> None:
    export = json.loads(EXPORT.read_text())
    figures = aiperf_figures(export)
    assert set(figures) == {*METRICS, "completed"}
    assert figures["completed"] == 32
    assert figures["output_throughput"] == pytest.approx(21.7833, abs=1e-3)
    assert figures["median_ttft_ms"] == pytest.approx(8864.754, abs=1e-3)
    # vLLM's TPOT is AIPerf's inter-token latency; vLLM's ITL its inter-chunk latency.
    assert figures["mean_tpot_ms"] == pytest.approx(231.582, abs=1e-3)
    assert figures["p99_itl_ms"] == pytest.approx(520.013, abs=1e-3)


def test_failed_requests_do_not_count_and_an_unfinished_run_is_refused() -> None:
    export = json.loads(EXPORT.read_text())
    export["error_request_count"] = {"unit": "requests", "avg": 3.0}
    assert aiperf_figures(export)["completed"] == 29
    export["is_complete"] = False
    with pytest.raises(ValueError, match="did not complete"):
        aiperf_figures(export)


def test_aiperf_runs_the_benchs_workload(tmp_path: Path) -> None:
    args = argparse.Namespace(input_len=256, output_len=64, concurrency=8, num_requests=32)
    argv = aiperf_argv(Path("aiperf"), "http://h:1", "m", Path("tok"), args, tmp_path)
    assert argv[:2] == ["aiperf", "profile"]
    assert "--streaming" in argv
    expected = {
        "--synthetic-input-tokens-mean": "256",
        "--output-tokens-mean": "64",
        "--concurrency": "8",
        "--request-count": "32",
        "--extra-inputs": "ignore_eos:true",
        "--endpoint-type": "completions",
        "--artifact-dir": str(tmp_path),
    }
    assert {k: argv[argv.index(k) + 1] for k in expected} == expected
