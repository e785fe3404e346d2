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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(summarize_file(args.trace, args.steps), indent=2))


if __name__ == "__main__":
    main()
