"""`pdmesh bench --fuzz`: thousands of hostile requests (every class of this package, the
structured-output one included) against a mesh of its own (`pdmesh up --prefill 1 --decode 1`
with the engine flags given) or one already running (--fuzz-target HOST:PORT for gRPC,
--fuzz-http URL for HTTP), eight at a time, and a table of what came back: cases and statuses by
class, worker deaths and restarts (the router's /metrics; `pdmesh up`'s own lines), and every
failure with the request that caused it. Exit code 1 on any failure or worker death.

    pdmesh bench --fuzz [--fuzz-cases 3000] [--seed 0] [--model M] [--max-model-len 256]
    pdmesh bench --fuzz --fuzz-target 127.0.0.1:50051 --fuzz-http http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdmesh.bench.fuzz import all_cases
from pdmesh.bench.fuzz.checks import Outcome, fuzz
from pdmesh.bench.report import write_json_out
from pdmesh.flags import engine_argv, engine_options
from pdmesh.mesh import quiet_up, read_services
from pdmesh.processes import free_port
from pdmesh.supervisor import stop


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    worker_exits: list[str] = field(default_factory=list)  # pdmesh up's lines about them
    # What the router's /metrics counted during the run: workers that left the rotation, and
    # came back as new processes.
    workers_down: float = 0.0
    worker_restarts: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem is not None]

    @property
    def ok(self) -> bool:
        deaths = self.worker_exits or self.workers_down or self.worker_restarts
        return not self.failures and not deaths

    def table(self, max_failures: int = 20) -> str:
        by_class: dict[str, Counter[str]] = {}
        for o in self.outcomes:
            by_class.setdefault(f"{o.case.channel} {o.case.kind}", Counter())[o.status] += 1
        lines = [f"{'class':<20} {'cases':>6}  statuses", "-" * 78]
        for name, statuses in sorted(by_class.items()):
            counts = ", ".join(f"{s.split(' ', 1)[1]} {n}" for s, n in statuses.most_common())
            lines.append(f"{name:<20} {sum(statuses.values()):>6}  {counts}")
        total = Counter(o.status for o in self.outcomes)
        lines += [
            "-" * 78,
            f"{'all':<20} {len(self.outcomes):>6}  "
            + ", ".join(f"{s} {n}" for s, n in total.most_common()),
        ]
        lines.append(
            f"workers: {self.workers_down:.0f} left the rotation, {self.worker_restarts:.0f} "
            f"restarted (router /metrics); pdmesh up saw {len(self.worker_exits)} exits"
        )
        lines += [f"  {line.strip()}" for line in self.worker_exits]
        failures = self.failures
        lines.append(f"failures: {len(failures)}")
        for o in failures[:max_failures]:
            lines.append(f"  {o.status}: {o.problem}\n    {o.case.describe()}")
        if len(failures) > max_failures:
            lines.append(f"  ... and {len(failures) - max_failures} more")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        return {
            "cases": len(self.outcomes),
            "statuses": dict(Counter(o.status for o in self.outcomes)),
            "worker_exits": self.worker_exits,
            "workers_down": self.workers_down,
            "worker_restarts": self.worker_restarts,
            "failures": [
                {"status": o.status, "problem": o.problem, "request": o.case.describe(2000)}
                for o in self.failures
            ],
        }


def worker_counts(http_base: str) -> tuple[float, float]:
    """(times workers left the rotation, restarts) as the router's /metrics count them."""
    with urllib.request.urlopen(f"{http_base}/metrics", timeout=10) as r:
        text = r.read().decode()
    down = restarts = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdmesh_router_worker_down_total":
                down += sample.value
            elif sample.name == "pdmesh_router_worker_restarts_total":
                restarts += sample.value
    return down, restarts


def worker_exits(output: Iterable[str]) -> list[str]:
    """`pdmesh up`'s lines saying a service exited or restarted."""
    return [line for line in output if "exited (code" in line or "restarting" in line]


def run_fuzz_bench(args: argparse.Namespace) -> int:
    target, http_base = args.fuzz_target, args.fuzz_http
    proc: subprocess.Popen[str] | None = None
    output: list[str] = []
    if (target is None) != (http_base is None):
        raise SystemExit("pdmesh bench --fuzz: give both --fuzz-target and --fuzz-http, or none.")
    if target is None:
        proc, target, http_base = _start_mesh(args, output)
    counts = Counter[str]()
    lock = threading.Lock()

    def progress(batch: list[Outcome]) -> None:
        with lock:
            before = counts["sent"]
            counts["sent"] += len(batch)
            counts["failed"] += sum(o.problem is not None for o in batch)
            if counts["sent"] // 400 > before // 400:
                print(f"  {counts['sent']} cases sent, {counts['failed']} failed", flush=True)

    print(f"fuzz: {args.fuzz_cases} hostile requests at {target} and {http_base}", flush=True)
    try:
        down, restarts = worker_counts(http_base)
        strategy = all_cases(structured=True)
        report = Report(fuzz(strategy, args.fuzz_cases, target, http_base, args.seed, progress))
        report.worker_exits = worker_exits(output)
        after = worker_counts(http_base)
        report.workers_down, report.worker_restarts = after[0] - down, after[1] - restarts
    finally:
        if proc is not None:
            stop(proc, 60)
    print(report.table())
    write_json_out(args.json_out, report.as_dict())
    return 0 if report.ok else 1


FUZZ_MAX_MODEL_LEN = 256  # the mesh's context when --max-model-len is not given


def _start_mesh(
    args: argparse.Namespace, output: list[str]
) -> tuple[subprocess.Popen[str], str, str]:
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    flags = ["--prefill", "1", "--decode", "1", "--disagg-min-tokens", "16"]
    if args.max_model_len is None:
        # A request may leave max_tokens unset (null): it then runs to the end of the context,
        # as OpenAI's and vLLM's do. At the default model's 8,192 tokens that is minutes of
        # CPU time per case, which the per-case time limit would report as a hang; a short
        # context keeps every case's answer within it.
        args.max_model_len = FUZZ_MAX_MODEL_LEN
    cmd = quiet_up(port, *flags, *engine_argv(engine_options(args)), http_port=http_port)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        read_services(proc.stdout, output.append)
    except RuntimeError:
        raise RuntimeError(
            f"pdmesh up exited with code {proc.wait()}:\n" + "".join(output[-30:])
        ) from None
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
