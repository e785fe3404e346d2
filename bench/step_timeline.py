"""Where a rank's decode steps go, read from its torch.profiler Chrome trace.

    python -m pdmesh.bench.step_timeline TRACE.json [--steps N]

The GPU's kernels over the profiled window are split into compute, NCCL (sends and receives; a
receive's kernel lasts from its launch until the peer's data has arrived, so it includes the
wait for the stage before) and idle (no kernel running). On the host: the time spent in calls
that wait for the GPU (stream, event and device synchronisations) and their number.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per-step milliseconds of one rank's trace (`steps`: decode steps in the window)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per = 1e3 * steps
    by_op: dict[str, float] = defaultdict(float)  # host operators and annotations, inclusive
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_op[e["name"][:80]] += e["dur"]
    top_ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:20]
    host = {"top_host_ops_ms_per_step": {k: round(v / per, 4) for k, v in top_ops}}
    if not kernels:  # a CPU run: the host's side only
        return {"kernels": 0, **host}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    busy = _union_us(comm + compute)
    by_comm: dict[str, float] = defaultdict(float)
    for e in kernels:
        if "nccl" in e["name"].lower():
            by_comm[e["name"][:60]] += e["dur"]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in _SYNCS]
    by_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kernel[e["name"][:80]] += e["dur"]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {
        "window_ms_per_step": (end - start) / per,
        "compute_ms_per_step": _union_us(compute) / per,
        "nccl_ms_per_step": _union_us(comm) / per,
        "idle_ms_per_step": (end - start - busy) / per,
        "nccl_kernels_ms_per_step": {k: v / per for k, v in sorted(by_comm.items())},
        "kernels_per_step": len(kernels) / steps,
        "host_syncs_per_step": len(syncs) / steps,
        "host_sync_ms_per_step": sum(e["dur"] for e in syncs) / per,
        "top_kernels_ms_per_step": {k: round(v / per, 4) for k, v in top},
        **host,
    }


def summarize_file(path: Path, steps: int) -> dict[str, Any]:
    return summarize(json.loads(path.read_text()), steps)


def _spans(trace: dict[str, Any], name: str) -> list[tuple[float, float]]:
    """(start, end) in µs since the epoch of every host span or runtime call named `name`
    (the ranks of one host share the clock, so their traces line up)."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    return sorted(
        (base + e["ts"], base + e["ts"] + e["dur"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("name") == name
    )


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def follower_lag(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """How far behind rank 0 each follower runs a step, from the host spans of one profile on
    every rank (engine/executor/profiling.py `span`; a profile with host operators): the
    medians, in µs, of rank 0's spans (sending a step, launching one ahead, waiting for its
    tokens), each follower's (waiting for the next step, receiving it, running it), and, step by
    step, how long after rank 0's graph launch the follower launched its own."""

    def durations(trace: dict[str, Any], name: str) -> float | None:
        return _median([e - s for s, e in _spans(trace, name)])

    lead = traces[0]
    result: dict[str, Any] = {
        "rank0": {
            name: durations(lead, name)
            for name in ("driver.send_step", "engine.launch_next", "engine.collect")
        }
    }
    graphs = _spans(lead, "cudaGraphLaunch")
    for r, trace in enumerate(traces[1:], start=1):
        their_graphs = _spans(trace, "cudaGraphLaunch")
        entry = {
            name: durations(trace, name)
            for name in ("follower.wait_step", "follower.receive_step", "follower.run_step")
        }
        # The k-th graph launch of each rank in the window is the same step (every rank starts
        # profiling between two steps); a rank may end the window with one more.
        entry["graph_after_rank0_graph"] = _median(
            [g[0] - g0[0] for g0, g in zip(graphs, their_graphs, strict=False)]
        )
        result[f"rank{r}"] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(summarize_file(args.trace, args.steps), indent=2))


if __name__ == "__main__":
    main()
