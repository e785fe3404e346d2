"""`pdmesh bench --serve --peer vllm`: the serving path against `vllm serve`, both driven by
vLLM's own serving benchmark client (`vllm bench serve`) with the same requests and load, or by
NVIDIA's AIPerf (`--client aiperf`, bench/aiperf_client.py).

On this machine, one after the other (never together: they would share the cores): `vllm serve`
(vLLM's CPU build, from the venv `--peer-venv`, made when missing) and `pdmesh up --colocated`
(`--disagg`: `pdmesh up --prefill 1 --decode 1`), each on the same model folder (the embedded
default unless `--model`), fp32, the same `--max-model-len`, served under one name. Each server
is started, waited for (a completion of one token answered), measured with

    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
        --random-input-len IN --random-output-len OUT --num-prompts N --max-concurrency C
        --ignore-eos --seed 0

and stopped. `--rounds` alternates them that many times. Reports output tokens/s, TTFT and
inter-token latency (mean, median, p99) of each run and pdmesh's ratios to vLLM's; writes every
run's client result with `--json-out`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmesh.bench.aiperf_client import aiperf_argv, aiperf_cli, aiperf_figures, read_export
from pdmesh.bench.offline import VLLM_MEMORY_FRACTION, peer_script, vllm_env, vllm_python
from pdmesh.checkpoint.source import model_display_name, resolve_model_folder
from pdmesh.processes import free_port

READY_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 1800.0
METRICS = (
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


class Server:
    """A server process group on `port`, its output in `log`; stopped with the whole group."""

    def __init__(
        self, argv: list[str], port: int, log: Path, cwd: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, model: str) -> float:
        """Seconds until a one-token completion is answered (the server, its engine, its
        tokenizer all up); RuntimeError if the process ends first."""
        start = time.monotonic()
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
        while time.monotonic() - start < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting")
            request = urllib.request.Request(
                f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"no completion from {self.url} within {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        """Stop the server and every process it started (its engine's too), so that none of
        them is still running while the next server is measured."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while self._group_alive():
            self.proc.poll()  # reap the leader, or the group stays alive as a zombie's
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 60
            time.sleep(0.2)
        self.proc.wait()

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


@dataclass(frozen=True)
class Comparison:
    """What both servers and every run share: vLLM's command line (`cli`, the peer venv's python
    running bench/vllm_cli.py; empty when neither vLLM's server nor its client runs), AIPerf's
    (`aiperf`, with `--client aiperf`), the model's folder and served name, the length, the
    flags."""

    cli: list[str]
    aiperf: Path | None
    folder: Path
    name: str
    max_len: int
    args: argparse.Namespace
    work: Path  # logs, the clients' results, the script vLLM runs from

    def server_argv(self, engine: str, port: int) -> list[str]:
        if engine == "vllm":
            return [*self.cli, "serve", str(self.folder), "--port", str(port),
                    "--dtype", "float32", "--max-model-len", str(self.max_len), "--seed", "0",
                    "--served-model-name", self.name,
                    "--gpu-memory-utilization", str(VLLM_MEMORY_FRACTION)]  # fmt: skip
        # The model as the user gave it (None: the embedded default), so that it is served under
        # the name `model_display_name` gives, which vLLM is told to use too.
        layout = ["--prefill", "1", "--decode", "1"] if self.args.disagg else ["--colocated"]
        model = ["--model", self.args.model] if self.args.model else []
        return [sys.executable, "-m", "pdmesh.cli", "up", *layout, "--port", str(free_port()),
                "--http-port", str(port), *model, "--max-model-len", str(self.max_len)]  # fmt: skip

    def client_argv(self, url: str, out: Path) -> list[str]:
        a = self.args
        return [*self.cli, "bench", "serve", "--backend", "openai", "--base-url", url,
                "--endpoint", "/v1/completions", "--model", self.name,
                "--tokenizer", str(self.folder), "--dataset-name", "random",
                "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len or 64),
                "--num-prompts", str(a.num_requests),
                "--max-concurrency", str(a.concurrency or 8), "--ignore-eos", "--seed", "0",
                "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
                "--save-result", "--save-detailed", "--result-dir", str(out.parent),
                "--result-filename", out.name]  # fmt: skip

    def client(self, url: str, stem: str) -> tuple[list[str], Callable[[], dict[str, Any]]]:
        """The client's command line against `url`, and what reads its figures once it ran
        (its results under this run's `stem` in the work folder)."""
        if self.aiperf is None:
            result = self.work / f"{stem}.json"
            return self.client_argv(url, result), lambda: json.loads(result.read_text())
        artifacts = self.work / f"{stem}-aiperf"  # AIPerf writes a folder of files
        argv = aiperf_argv(self.aiperf, url, self.name, self.folder, self.args, artifacts)
        return argv, lambda: aiperf_figures(read_export(artifacts))

    def measure(self, engine: str, index: int) -> dict[str, Any]:
        """Start one server, run the client against it, stop it: the client's figures."""
        port, log = free_port(), self.work / f"{engine}-{index}.log"
        load_before = os.getloadavg()[0]  # the machine's 1-minute load as the server starts
        env = vllm_env(self.args.peer_cores) if engine == "vllm" else None
        server = Server(self.server_argv(engine, port), port, log, cwd=self.work, env=env)
        try:
            ready_s = server.wait_ready(self.name)
            argv, figures_of_run = self.client(server.url, f"{engine}-{index}")
            with log.open("ab") as out:
                subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.work,
                               check=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
            data = figures_of_run()
        finally:
            server.stop()
        wanted = self.args.num_requests
        if data.get("completed") != wanted:
            raise RuntimeError(f"{engine}: {data.get('completed')} of {wanted} completed")
        figures = {k: data[k] for k in METRICS if k in data}
        figures.update(engine=engine, ready_s=round(ready_s, 1), completed=data["completed"])
        figures["load_before"] = round(load_before, 2)
        return figures


def run_serve_peer_bench(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="pdmesh-serve-peer-"))
    aiperf = aiperf_cli(Path(args.aiperf_venv).expanduser()) if args.client == "aiperf" else None
    cli: list[str] = []
    if aiperf is None or not args.skip_peer:  # vLLM's client, or its server, runs
        python = vllm_python(Path(args.peer_venv).expanduser())  # made once when missing
        cli = [str(python), str(peer_script("vllm_cli.py", work))]
    comparison = Comparison(
        cli=cli,
        aiperf=aiperf,
        folder=resolve_model_folder(args.model),
        name=model_display_name(args.model),
        max_len=args.max_model_len or 1024,
        args=args,
        work=work,
    )
    runs: list[dict[str, Any]] = []
    for index in range(args.rounds):
        for engine in ("pdmesh",) if args.skip_peer else ("vllm", "pdmesh"):
            runs.append(comparison.measure(engine, index))
            print(json.dumps(runs[-1]), flush=True)
    summary = summarize(runs)
    print(table(runs, summary))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"workload": workload(args), "runs": runs, "summary": summary}, indent=1)
        )
    print(f"logs and client results: {work}")
    return 0


def workload(args: argparse.Namespace) -> dict[str, Any]:
    client = "vllm bench serve (random dataset, /v1/completions, ignore_eos)"
    if args.client == "aiperf":
        client = "aiperf profile (synthetic prompts, completions, streaming, ignore_eos)"
    return {
        "client": client,
        "num_prompts": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len or 64,
        "max_concurrency": args.concurrency or 8,
        "pdmesh_layout": "pdmesh up --prefill 1 --decode 1" if args.disagg else "--colocated",
        "vllm_cores": args.peer_cores,
        "cores": os.cpu_count(),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of each engine, and pdmesh's ratio to vLLM's for each figure."""
    if not any(r["engine"] == "vllm" for r in runs):  # --skip-peer
        return {"median": {}, "pdmesh_over_vllm": {}}
    med = {
        engine: {
            k: statistics.median(r[k] for r in runs if r["engine"] == engine)
            for k in METRICS
            if all(k in r for r in runs)
        }
        for engine in ("vllm", "pdmesh")
    }
    ratios = {k: med["pdmesh"][k] / med["vllm"][k] for k in med["pdmesh"] if med["vllm"].get(k)}
    return {"median": med, "pdmesh_over_vllm": ratios}


def table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    cols = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
            "p99_itl_ms")  # fmt: skip
    rows = ["| run | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]
    for i, r in enumerate(runs):
        rows.append(
            f"| {r['engine']} {i // 2 + 1} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |"
        )
    ratio = summary["pdmesh_over_vllm"]
    if ratio:
        rows.append(
            "| pdmesh / vLLM (medians) | " + " | ".join(f"{ratio[c]:.2f}" for c in cols) + " |"
        )
    return "\n".join(rows)
