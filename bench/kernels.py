"""Kernel micro-benchmark: every Triton kernel against its torch reference, on a CUDA device.

    python -m pdmesh.bench.kernels --out DIR [--only NAME] [--smoke]

For each case (see `kernel_cases.py`): the relative error of the Triton result against the
reference, the median time of both (`triton.testing.do_bench`), the achieved bandwidth (least
bytes moved / time) and TFLOP/s, and the fraction of the roofline reached: the ideal time
max(bytes / copy bandwidth, FLOPs / matmul peak) over the measured time. The two ceilings are
measured in the same run: a 1 GiB device-to-device copy (read + write bytes) and an 8192^3 bf16
matmul. Prints a table and writes DIR/kernels.json.

`--smoke` runs tiny shapes once each, without do_bench; on a machine without CUDA it runs the
kernels under the Triton interpreter (to check the script itself, not to time anything).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from pdmesh.bench.kernel_cases import SMOKE, Case, Shapes, all_cases, rel_err
from pdmesh.bench.report import Report, Timer, ceilings, median_s, out_parser


@dataclass(frozen=True)
class Result:
    kernel: str
    shape: str
    rel_err: float
    ok: bool
    triton_us: float
    torch_us: float
    speedup: float
    gbytes_per_s: float
    tflops: float
    bw_ratio: float  # achieved bandwidth / copy ceiling
    flops_ratio: float  # achieved FLOP/s / matmul ceiling
    roofline: float  # ideal time at both ceilings / measured time


def _timer(device: torch.device, smoke: bool) -> Timer:
    """Seconds per call: do_bench's median on CUDA; one wall-clock call in smoke mode."""
    if smoke or device.type != "cuda":

        def once(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        return once
    return lambda fn: median_s(fn, rep=100)  # do_bench's default repetitions


def measure_ceilings(device: torch.device, timer: Timer, smoke: bool) -> dict[str, float]:
    """copy_bytes_per_s (read + write bytes of a device-to-device copy) and matmul_flops_per_s
    (dense bf16), of 1 GiB buffers and an 8192^3 matmul at full size."""
    c = ceilings(timer, 1 << (16 if smoke else 29), 256 if smoke else 8192, device.type)
    return {
        "copy_bytes_per_s": c["copy_gb_s"] * 1e9,
        "matmul_flops_per_s": c["matmul_tflop_s"] * 1e12,
    }


def run_case(case: Case, timer: Timer, ceil: dict[str, float], tol: float) -> Result:
    err = case.check() if case.check else rel_err(case.triton_fn(), case.torch_fn())
    t_triton = timer(case.triton_fn)
    t_torch = timer(case.torch_fn)
    bw, mm = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    ideal = max(case.bytes_moved / bw, case.flops / mm)
    return Result(
        kernel=case.kernel,
        shape=case.shape,
        rel_err=err,
        ok=err < tol,
        triton_us=t_triton * 1e6,
        torch_us=t_torch * 1e6,
        speedup=t_torch / t_triton,
        gbytes_per_s=case.bytes_moved / t_triton / 1e9,
        tflops=case.flops / t_triton / 1e12,
        bw_ratio=case.bytes_moved / t_triton / bw,
        flops_ratio=case.flops / t_triton / mm,
        roofline=ideal / t_triton,
    )


def format_table(results: Sequence[Result], ceil: dict[str, float]) -> str:
    lines = [
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s (read+write), "
        f"bf16 matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s",
        f"{'kernel':<24}{'shape':<34}{'triton us':>10}{'torch us':>10}{'x':>7}"
        f"{'GB/s':>8}{'TFLOP/s':>9}{'bw%':>6}{'mm%':>6}{'roof%':>7}{'rel err':>10}",
    ]
    for r in results:
        lines.append(
            f"{r.kernel:<24}{r.shape:<34}{r.triton_us:>10.1f}{r.torch_us:>10.1f}"
            f"{r.speedup:>7.2f}{r.gbytes_per_s:>8.0f}{r.tflops:>9.1f}{100 * r.bw_ratio:>6.0f}"
            f"{100 * r.flops_ratio:>6.0f}{100 * r.roofline:>7.0f}{r.rel_err:>10.1e}"
            + ("" if r.ok else "  WRONG")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.prog = "python -m pdmesh.bench.kernels"
    parser.add_argument("--only", default="", help="run the kernels whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing loop")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("needs a CUDA device (or --smoke, which runs under the Triton interpreter)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    shapes = SMOKE if args.smoke else Shapes()
    timer = _timer(device, args.smoke)
    torch.manual_seed(0)

    ceil = measure_ceilings(device, timer, args.smoke)
    results: list[Result] = []
    for case in all_cases(shapes, dtype, device):
        if args.only in case.kernel:
            results.append(run_case(case, timer, ceil, tol))
            print(format_table(results[-1:], ceil).splitlines()[-1], flush=True)
    print()
    print(format_table(results, ceil))

    report = Report(
        args.out / "kernels.json",
        command=" ".join([parser.prog, *argv]),
        device=torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        dtype=str(dtype),
        torch=torch.__version__,
        triton=triton.__version__,
        smoke=args.smoke,
        ceilings=ceil,
        results=[asdict(r) for r in results],
    )
    report.save()
    print(f"wrote {report.path}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
