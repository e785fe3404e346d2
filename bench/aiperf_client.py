"""NVIDIA's serving benchmark client, AIPerf, as the client of `pdmesh bench --serve --client
aiperf`: the same servers and workload as with `vllm bench serve`, driven by another client that
users of Dynamo and TensorRT-LLM measure with, unchanged (the OpenAI `/v1/completions` endpoint,
streamed, as it sends it).

AIPerf lives in a venv of its own (`--aiperf-venv`, made the first time: it needs the package
registry once, and brings pandas, pyarrow and scipy, ~1.2 GB), and is run as

    aiperf profile --model NAME --url URL --endpoint-type completions --streaming
        --tokenizer FOLDER --synthetic-input-tokens-mean IN --synthetic-input-tokens-stddev 0
        --output-tokens-mean OUT --output-tokens-stddev 0 --extra-inputs ignore_eos:true
        --concurrency C --request-count N --random-seed 0 --ui-type none --artifact-dir DIR

Its export (DIR/profile_export_aiperf.json) gives the figures under the names `vllm bench
serve` uses, so both clients fill one table. The definitions differ a little: AIPerf's
inter-token latency is a request's (decode time / (tokens - 1), what vLLM calls TPOT, here
`mean_tpot_ms`) and its inter-chunk latency the gap between streamed chunks (vLLM's ITL, here
`*_itl_ms`); it counts output tokens by tokenizing the streamed text again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

AIPERF_SPEC = "aiperf==0.13.0"
EXPORT = "profile_export_aiperf.json"


def aiperf_cli(venv: Path) -> Path:
    """The `aiperf` of a venv holding AIPerf, made (once) when missing."""
    cli = venv / "bin" / "aiperf"
    if cli.exists():
        return cli
    print(f"installing {AIPERF_SPEC} into {venv} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", AIPERF_SPEC], check=True)
    return cli


def aiperf_argv(
    cli: Path, url: str, name: str, folder: Path, args: argparse.Namespace, out: Path
) -> list[str]:
    """`aiperf profile` for the bench's workload against the server at `url`; its artifacts
    (the export among them) go to the folder `out`."""
    return [str(cli), "profile", "--model", name, "--url", url,
            "--endpoint-type", "completions", "--streaming", "--tokenizer", str(folder),
            "--synthetic-input-tokens-mean", str(args.input_len),
            "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_len or 64), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--concurrency", str(args.concurrency or 8),
            "--request-count", str(args.num_requests), "--random-seed", "0",
            "--ui-type", "none", "--artifact-dir", str(out)]  # fmt: skip


def aiperf_figures(export: dict[str, Any]) -> dict[str, Any]:
    """AIPerf's export as the figures `vllm bench serve` reports (serve_peer.METRICS), with
    `completed` the requests that succeeded; ValueError if the run did not complete."""
    if not export.get("is_complete") or export.get("was_cancelled"):
        raise ValueError("the AIPerf run did not complete")

    def stat(metric: str, key: str) -> float:
        return float(export[metric][key])

    errors = export.get("error_request_count") or {}
    return {
        "output_throughput": stat("output_token_throughput", "avg"),
        "request_throughput": stat("request_throughput", "avg"),
        "mean_ttft_ms": stat("time_to_first_token", "avg"),
        "median_ttft_ms": stat("time_to_first_token", "p50"),
        "p99_ttft_ms": stat("time_to_first_token", "p99"),
        "mean_tpot_ms": stat("inter_token_latency", "avg"),
        "mean_itl_ms": stat("inter_chunk_latency", "avg"),
        "median_itl_ms": stat("inter_chunk_latency", "p50"),
        "p99_itl_ms": stat("inter_chunk_latency", "p99"),
        "completed": int(stat("request_count", "avg")) - int(errors.get("avg", 0)),
    }


def read_export(out: Path) -> dict[str, Any]:
    return json.loads((out / EXPORT).read_text())
