"""FP8 W8A8 products at decode batches (16-64 tokens): cuBLASLt's fp8 GEMM (torch._scaled_mm)
against the swapped-operand Triton GEMM (kernels/triton/fp8_gemm.py) and its launch shapes, on
the Llama-3.1-8B projections (TP=1).

    python -m pdmesh.bench.fp8_gemm_gpu --out DIR [--batches 16,32,64] [--quick]

Both take the same quantized activation; the per-token quantization is not in either figure.
Each figure is one call's share of a CUDA graph cycling through weight copies several times the
L2 (bench/gemv_gpu.py's method); the floor is the fp8 weight's bytes over the copy bandwidth
measured in the same run. Every shape is checked against the fp32 emulation before it is timed.
Writes DIR/fp8-gemm.json, prints a table.
"""

from __future__ import annotations

from typing import Any

import torch

from pdmesh.bench.gemv_gpu import L2_SPAN, WHOLE, per_call_us
from pdmesh.bench.kernel_cases import rel_err
from pdmesh.bench.report import Report, ceilings, free_memory, out_parser, run_info
from pdmesh.kernels.fp8 import quantize_rows_ref, scaled_mm_ref
from pdmesh.kernels.triton.fp8_gemm import Fp8GemmConfig, fp8_gemm, fp8_gemm_config

SHAPES = ["qkv", "o", "gate_up", "down"]


def sweep(t: int) -> list[Fp8GemmConfig]:
    block_t = max(16, min(64, 1 << (t - 1).bit_length()))
    return [
        Fp8GemmConfig(bn, block_t, bk, warps, stages)
        for bn in (32, 64, 128)
        for bk in (128, 256)
        for warps in ((4, 8) if bn == 128 else (4,))
        for stages in (3, 5)
    ]


def measure(name: str, t: int, quick: bool, bw: float) -> dict[str, Any]:
    n, k = WHOLE[name]
    copies = max(8, -(-L2_SPAN // (n * k)))
    pairs = [quantize_rows_ref(torch.randn(n, k, device="cuda")) for _ in range(copies)]
    xq, xs = quantize_rows_ref(torch.randn(t, k, device="cuda"))
    ref = scaled_mm_ref(xq, xs, *pairs[0], None, torch.float32)
    cublas = per_call_us(
        lambda p: torch._scaled_mm(
            xq, p[0].t(), scale_a=xs[:, None], scale_b=p[1][None, :], out_dtype=torch.bfloat16
        ),
        pairs,
    )
    default = fp8_gemm_config(t, n, k, xq.device)
    tried: list[dict[str, Any]] = []
    for cfg in [default, *([] if quick else [c for c in sweep(t) if c != default])]:
        try:
            err = rel_err(fp8_gemm(xq, xs, *pairs[0], None, config=cfg), ref)
        except Exception as e:  # a shape the compiler refuses (shared memory): recorded
            tried.append({"config": cfg._asdict(), "error": type(e).__name__})
            continue
        if not err < 1e-2:
            tried.append({"config": cfg._asdict(), "rel_err": err, "error": "wrong result"})
            continue
        us = per_call_us(lambda p, c=cfg: fp8_gemm(xq, xs, p[0], p[1], None, config=c), pairs)
        tried.append({"config": cfg._asdict(), "rel_err": err, "us": us})
    del pairs
    free_memory()
    timed = [r for r in tried if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    floor = n * k / bw * 1e6
    return {
        "shape": name,
        "tokens": t,
        "n": n,
        "k": k,
        "floor_us": floor,
        "cublas_us": cublas,
        "default_us": tried[0].get("us"),
        "best_us": best["us"],
        "best_config": best["config"],
        "cublas_ratio": cublas / floor,
        "best_ratio": best["us"] / floor,
        "tried": tried,
    }


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--batches", default="16,32,64")
    parser.add_argument("--quick", action="store_true", help="the default launch shape only")
    args = parser.parse_args(argv)
    c = ceilings()
    report = Report(args.out / "fp8-gemm.json", indent=1, **run_info(), ceilings=c, results=[])
    for t in (int(b) for b in args.batches.split(",")):
        for name in SHAPES:
            r = measure(name, t, args.quick, c["copy_gb_s"] * 1e9)
            report.append("results", r)
            print(
                f"{name:8s} T={t:3d} floor {r['floor_us']:7.1f} us  cuBLAS {r['cublas_us']:7.1f}"
                f" ({r['cublas_ratio']:.2f}x)  default {r['default_us'] or 0:7.1f}  best "
                f"{r['best_us']:7.1f} ({r['best_ratio']:.2f}x) {tuple(r['best_config'].values())}",
                flush=True,
            )
    print(f"copy {c['copy_gb_s']:.0f} GB/s, read {c['read_gb_s']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
