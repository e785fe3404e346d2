"""The decode projections at batch 1-4: the GEMV kernel's launch shapes against the matmul
library, on the Llama-3.1-8B matrices whole (TP=1) and as one rank's shard of TP=2.

    python -m pdmesh.bench.gemv_gpu --out DIR [--quick] [--quantization fp8] [--shapes qkv,o]
        [--rows 1]   (shapes: qkv o gate_up down lm_head down+silu, "tp2 " before each,
                      moe-qkv moe-o moe-router)

Each figure is one call's share of a CUDA graph that runs the same projection over 8+ copies of
its weight in turn (the copies together several times the L2, as in a decode step, where each
matrix is read once), so neither launch gaps nor the cache flatter it. The floor is the weight's
bytes over the copy bandwidth measured in the same run (read + write bytes of a 2 GiB copy);
the read rate (a 2 GiB sum) is given too, since a GEMV only reads. Every launch shape is checked
against a float64 reference on fresh inputs before it is timed. Writes DIR/gemv.json, prints a
table. With --quantization fp8 (batch 1; TP=1 q/k/v, o, gate/up, down + SiLU): the weights are
float8 with row scales, the library's figure is the per-token quantization then cuBLASLt's fp8
GEMM (torch._scaled_mm), and the floor counts one byte per weight (DIR/gemv-fp8.json). The
default launch shape is also timed without programmatic dependent launch (PDMESH_PDL=0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdmesh.bench.kernel_cases import rel_err
from pdmesh.bench.report import Report, ceilings, free_memory, median_s, out_parser, run_info
from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.fp8 import dequantize_rows, quantize_rows_ref
from pdmesh.kernels.triton.activation import silu_and_mul
from pdmesh.kernels.triton.fp8_linear import fp8_gemv_config, quantize_rows, scaled_mm
from pdmesh.kernels.triton.gemv import GemvConfig, default_config, gemv

# (N, K) of Llama-3.1-8B's projections, whole; under TP=2 a rank holds half of N (column
# parallel) or, for the row-parallel o and down, half of K. A name ending in "+silu" is the down
# projection from the MLP's [gate | up] output: the library's figure is the SiLU kernel then
# F.linear, the GEMV's its gated form (one kernel).
WHOLE = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _tp2(name: str) -> tuple[str, int, int]:
    n, k = WHOLE[name]
    return (f"tp2 {name}", n, k // 2) if name in ("o", "down") else (f"tp2 {name}", n // 2, k)


SHAPES = [(name, *WHOLE[name]) for name in WHOLE] + [_tp2(name) for name in WHOLE]
SHAPES += [("down+silu", *WHOLE["down"]), ("tp2 down+silu", *_tp2("down")[1:])]
# Qwen3-30B-A3B's dense projections (hidden 2,048, 32 query and 4 KV heads of 128, 128 experts'
# router): the MoE shape's batch-1 step runs them at 1.7x their bytes (docs/benchmarks/one-gpu.md).
SHAPES += [("moe-qkv", 5120, 2048), ("moe-o", 2048, 4096), ("moe-router", 128, 2048)]
ROWS = (1, 2, 4)
L2_SPAN = 400 * 2**20  # bytes of weight copies a graph cycles through (H100/H200 L2: 50 MiB)


def sweep(rows: int, quick: bool) -> list[GemvConfig]:
    if quick:
        return []
    if rows == 1:
        return [
            GemvConfig(bn, bk, w, s)
            for bn in (4, 8, 16)
            for bk in (256, 512, 1024, 2048)
            for w in (4, 8)
            for s in (1, 3)
        ]
    return [GemvConfig(bn, bk, 4, s) for bn in (4, 8) for bk in (128, 256) for s in (1, 3)]


def sweep_fp8() -> list[GemvConfig]:
    elementwise = [
        GemvConfig(bn, bk, w, s)
        for bn, bk in ((4, 2048), (8, 1024), (8, 2048), (16, 512), (16, 1024))
        for w in (4, 8)
        for s in (1, 2, 3)
    ]
    each_tile = [
        GemvConfig(bn, bk, w, 1, reduce_each_tile=True)
        for bn, bk in ((8, 1024), (8, 2048), (8, 4096), (16, 1024), (16, 2048), (32, 1024))
        for w in (4, 8)
    ]
    return elementwise + each_tile


def measure_fp8(name: str, n: int, k: int, quick: bool, bw: float) -> dict[str, Any]:
    """Batch 1 against an fp8 weight: the GEMV's launch shapes and the W8A8 library path."""
    nbytes = n * k
    copies = max(8, -(-L2_SPAN // nbytes))
    pairs = [quantize_rows_ref(torch.randn(n, k, device="cuda")) for _ in range(copies)]
    gated = name.endswith("+silu")
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    ref = reference(x, dequantize_rows(*pairs[0], torch.float64), gated)

    def library(p: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xq, xs = quantize_rows(x, gated=gated)
        return scaled_mm(xq, xs, p[0], p[1], None, torch.bfloat16)

    library_us = per_call_us(library, pairs)
    tried: list[dict[str, Any]] = []
    default = fp8_gemv_config(1, n, k, gated)
    for cfg in [default, *([] if quick else [c for c in sweep_fp8() if c != default])]:
        out = gemv(x, pairs[0][0], config=cfg, gated=gated, scale=pairs[0][1])
        err = rel_err(out, ref)
        if not err < 1e-2:
            tried.append({"config": cfg._asdict(), "rel_err": err, "error": "wrong result"})
            continue
        us = per_call_us(
            lambda p, cfg=cfg: gemv(x, p[0], config=cfg, gated=gated, scale=p[1]), pairs
        )
        tried.append({"config": cfg._asdict(), "rel_err": err, "us": us})
    timed = [t for t in tried if "us" in t]
    best = min(timed, key=lambda t: t["us"])
    no_pdl_us = per_call_us(
        lambda p: gemv(x, p[0], config=default, gated=gated, scale=p[1], use_pdl=False), pairs
    )
    del pairs
    free_memory()
    floor_us = nbytes / bw * 1e6
    return {
        "shape": name,
        "rows": 1,
        "n": n,
        "k": k,
        "weight_mb": nbytes / 1e6,
        "floor_us": floor_us,
        "cublas_us": library_us,
        "default_us": timed[0]["us"] if tried[0].get("us") else None,
        "default_no_pdl_us": no_pdl_us,
        "best_us": best["us"],
        "best_config": best["config"],
        "cublas_ratio": library_us / floor_us,
        "best_ratio": best["us"] / floor_us,
        "tried": tried,
    }


def per_call_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds per call, from a graph of one call per weight copy."""
    for w in weights[:2]:
        fn(w)  # compile, pick cuBLAS kernels: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return median_s(graph.replay, warmup=10, rep=100) * 1e6 / len(weights)


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """The projection in float64 (after the MLP's SiLU-and-multiply if `gated`)."""
    return (silu_and_mul_ref(x) if gated else x).double() @ w.double().t()


def measure(name: str, n: int, k: int, rows: int, quick: bool, bw: float) -> dict[str, Any]:
    nbytes = n * k * 2
    copies = max(8, -(-L2_SPAN // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    gated = name.endswith("+silu")
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    floor_us = nbytes / bw * 1e6
    act = silu_and_mul if gated else (lambda t: t)
    cublas = per_call_us(lambda w: torch.nn.functional.linear(act(x), w), weights)
    tried: list[dict[str, Any]] = []
    default = default_config(rows, n, k)
    for cfg in [default, *[c for c in sweep(rows, quick) if c != default]]:
        err = rel_err(gemv(x, weights[0], config=cfg, gated=gated), reference(x, weights[0], gated))
        if not err < 1e-2:
            tried.append({"config": cfg._asdict(), "rel_err": err, "error": "wrong result"})
            continue
        us = per_call_us(lambda w, cfg=cfg: gemv(x, w, config=cfg, gated=gated), weights)
        tried.append({"config": cfg._asdict(), "rel_err": err, "us": us})
    timed = [t for t in tried if "us" in t]
    best = min(timed, key=lambda t: t["us"])
    no_pdl_us = per_call_us(
        lambda w: gemv(x, w, config=default, gated=gated, use_pdl=False), weights
    )
    del weights
    free_memory()
    return {
        "shape": name,
        "rows": rows,
        "n": n,
        "k": k,
        "weight_mb": nbytes / 1e6,
        "floor_us": floor_us,
        "cublas_us": cublas,
        "default_us": timed[0]["us"] if tried[0].get("us") else None,
        "default_no_pdl_us": no_pdl_us,
        "best_us": best["us"],
        "best_config": best["config"],
        "cublas_ratio": cublas / floor_us,
        "best_ratio": best["us"] / floor_us,
        "tried": tried,
    }


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="the default launch shape only")
    parser.add_argument("--quantization", default=None, help="fp8: fp8 weights, batch 1")
    parser.add_argument("--shapes", default=None, help="only these, by name (e.g. qkv,o,down+silu)")
    parser.add_argument("--rows", default=None, help="only these rows of x (e.g. 1)")
    args = parser.parse_args(argv)
    c = ceilings()
    fp8 = args.quantization == "fp8"
    name = "gemv-fp8.json" if fp8 else "gemv.json"
    report = Report(args.out / name, indent=1, **run_info(), ceilings=c, results=[])
    # FP8: the projections an fp8 engine runs on the GEMV (its LM head stays bf16), TP=1.
    shapes = [s for s in SHAPES if s[0] in ("qkv", "o", "gate_up", "down+silu")] if fp8 else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    all_rows = (1,) if fp8 else ROWS
    if args.rows:
        all_rows = tuple(r for r in all_rows if str(r) in args.rows.split(","))
    for name, n, k in shapes:
        for rows in all_rows:
            bw = c["copy_gb_s"] * 1e9
            if fp8:
                r = measure_fp8(name, n, k, args.quick, bw)
            else:
                r = measure(name, n, k, rows, args.quick, bw)
            report.append("results", r)
            print(
                f"{name:12s} M={rows} floor {r['floor_us']:7.1f} us  cuBLAS {r['cublas_us']:7.1f}"
                f" ({r['cublas_ratio']:.2f}x)  gemv default {r['default_us'] or 0:7.1f} "
                f"(without PDL {r['default_no_pdl_us']:7.1f})" + "  best "
                f"{r['best_us']:7.1f} ({r['best_ratio']:.2f}x) {tuple(r['best_config'].values())}",
                flush=True,
            )
    print(f"copy {c['copy_gb_s']:.0f} GB/s, read {c['read_gb_s']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
