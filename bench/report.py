"""What the benchmarks share: a JSON report written as each figure comes in, the run's device (and
on CPU, the CPU time of its processes and of the whole machine, from Linux /proc, so that a figure
says whether anything else was running), the hardware ceilings figures are compared with, and
token-list checks."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Timer = Callable[[Callable[[], object]], float]  # seconds per call of a function


def timed_into(totals: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding the wall-clock seconds of each call to totals[key] (a bench's way of timing a
    part of a step without touching the code it times)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


class Report:
    """Figures by key, rewritten to `path` as JSON whenever one is added (a run that dies keeps
    what it measured) and printed as they come; `head` is what the file starts with."""

    def __init__(self, path: Path, indent: int | None = 2, **head: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.indent, self.data = path, indent, dict(head)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=self.indent, default=float))

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()
        print(f"[{key}] {json.dumps(value, default=float)[:600]}", flush=True)  # the file has all

    def append(self, key: str, item: Any) -> None:
        """Add `item` to the list under `key` (saved, not printed)."""
        self.data.setdefault(key, []).append(item)
        self.save()

    def guarded(self, key: str, fn: Callable[[], Any]) -> None:
        """Record fn()'s figures, or its error (traceback printed): one failed measurement does
        not end the run. GPU memory it left cached is freed after."""
        try:
            value = fn()
        except Exception as e:
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
        self.record(key, value)
        free_memory()


def device_name() -> str:
    """The CPU model (e.g. 'Intel(R) Xeon(R) Processor'), or the architecture if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads, to the nanosecond (schedstat; /proc/PID/stat counts
    in clock ticks, 10 ms, too coarse for a process that uses a few ms a second). A thread that
    exits takes its time with it: for long-lived processes whose threads stay."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return total / 1e9


def machine_busy_seconds() -> float:
    """CPU seconds spent by the whole machine, all cores, to spot other load."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_info(name_key: str = "device") -> dict[str, Any]:
    """The device's name (under `name_key`), the torch version and the date."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {name_key: name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def out_parser(doc: str | None, out_required: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser (its docstring as help) with `--out DIR`, where its figures go."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=out_required, help="folder for the figures")
    return parser


def write_json_out(path: str | None, figures: Any) -> None:
    """A CPU benchmark's figures to its `--json-out` file, where one was given."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")


def free_memory() -> None:
    """Collect garbage and return cached GPU memory, so that the next model has the device."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_s(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> float:
    """Seconds per call of `fn` on the GPU: triton's do_bench median (L2 flushed between calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3


def replayed_us(
    fn: Callable[[], object], calls: int, replays: int, barrier: Callable[[], object], graph: bool
) -> float:
    """µs per call of `fn` among ranks: `calls` calls in a row (captured in one CUDA graph when
    `graph` and on a GPU, else run eagerly), the median of `replays` runs, each started after
    `barrier` (every rank in step). Three warm-up calls first (NCCL channels, symmetric memory)."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(3):
        fn()
    run: Callable[[], object]
    if cuda and graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = cuda_graph.replay
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

    times = []
    for _ in range(replays):
        barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e6


def ceilings(
    timer: Timer = median_s, elements: int = 1 << 30, n: int = 8192, device: str = "cuda"
) -> dict[str, float]:
    """The ceilings figures are compared with, measured now: copy bandwidth (GB/s, bytes read +
    written) and read bandwidth (a sum) of `elements` bf16 values (2 GiB: far beyond L2), and the
    rate of an n x n x n bf16 matmul (TFLOP/s)."""
    import torch

    a = torch.randn(elements, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_s = timer(lambda: b.copy_(a))
    read_s = timer(lambda: a.sum(dtype=torch.float32))
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = timer(lambda: x @ y)
    result = {
        "copy_gb_s": 2 * a.nbytes / copy_s / 1e9,
        "read_gb_s": a.nbytes / read_s / 1e9,
        "matmul_tflop_s": 2 * n**3 / matmul_s / 1e12,
    }
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        result["fp8_matmul_tflop_s"] = 2 * n**3 / fp8_matmul_s(timer, n) / 1e12
    return result


def fp8_matmul_s(timer: Timer, n: int) -> float:
    """Seconds of an n x n x n float8 e4m3 matmul with rowwise scales and bf16 output (the
    product FP8 projections run: torch._scaled_mm, cuBLASLt's fp8 tensor-core GEMM)."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    return timer(
        lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ, None where they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def compare_tokens(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Whether two runs' outputs agree, and where each pair first differs."""
    first = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
    return {"identical": all(f is None for f in first), "first_difference": first}
