"""Paged decode attention over bf16 and fp8 pages, the split kernel's tiles swept (issue 34).

    python -m pdmesh.bench.decode_tiles --out DIR [--batch 32 --context 8192]
    TRITON_INTERPRET=1 python -m pdmesh.bench.decode_tiles --out DIR --smoke   # CPU: tiny, fp16

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head dim 128, pages of 16 tokens,
shuffled): `batch` sequences of `context` tokens, one decode step's attention. For each tile
(tokens a step, pipeline stages, warps, dots in fp16 or not): the median time (do_bench, L2
flushed), the KV bytes read per second, and that over the read bandwidth measured in the same
run. bf16 pages run their default tile; fp8 pages every tile of the sweep, the default first.
Writes DIR/decode_tiles.json; prints a table.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from pdmesh.bench.report import Report, ceilings, median_s, out_parser, run_info
from pdmesh.kernels.kv_quant import FP8_KV_DTYPE, quantize
from pdmesh.kernels.triton.decode_attention import DecodeTile, default_tile, paged_decode_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
SWEEP = [
    DecodeTile(block_n, stages, warps, f16)
    for block_n, stages, warps, f16 in itertools.product(
        (32, 64, 128), (2, 3, 4), (4, 8), (True, False)
    )
]


def _inputs(batch: int, context: int, device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    pages = batch * (-(-context // PAGE))
    shape = (pages, PAGE, KV_HEADS, DIM)
    half = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter: no bf16
    k = torch.randn(shape, device=device, generator=g, dtype=half)
    v = torch.randn(shape, device=device, generator=g, dtype=half)
    order = torch.randperm(pages, device=device, generator=g)
    return {
        "q": torch.randn(batch, HEADS, DIM, device=device, generator=g, dtype=half),
        "bf16": (k, v),
        "fp8": (quantize(k, FP8_KV_DTYPE, 1.0), quantize(v, FP8_KV_DTYPE, 1.0)),
        "tables": order.view(batch, -1).to(torch.int32),
        "lens": torch.full((batch,), context, dtype=torch.int32, device=device),
    }


def sweep(batch: int, context: int, device: str, smoke: bool, read_gb_s: float) -> list[dict]:
    x = _inputs(batch, context, device)
    rows = []
    cases = [("bf16", default_tile(torch.bfloat16, torch.bfloat16))]
    fp8_default = default_tile(torch.bfloat16, FP8_KV_DTYPE)
    cases += [("fp8", fp8_default)] + [("fp8", t) for t in SWEEP if t != fp8_default]
    if smoke:
        cases = cases[:3]
    for kind, tile in cases:
        k, v = x[kind]
        args = (x["q"], k, v, x["tables"], x["lens"], DIM**-0.5, context)

        def run(args: tuple = args, tile: DecodeTile = tile) -> torch.Tensor:
            return paged_decode_attention(*args, tile=tile)

        try:
            seconds = median_s(run) if not smoke else _once(run)
        except Exception as e:  # a tile that does not fit the SM's registers or shared memory
            rows.append({"kind": kind, "tile": tile._asdict(), "error": str(e)[:200]})
            continue
        kv_bytes = 2 * batch * context * KV_HEADS * DIM * k.element_size()
        gb_s = kv_bytes / seconds / 1e9
        rows.append({"kind": kind, "tile": tile._asdict(), "us": seconds * 1e6,
                     "kv_gb_s": gb_s, "of_read_rate": gb_s / read_gb_s})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def _once(fn: Any) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def table(rows: list[dict]) -> str:
    lines = ["| pages | tokens a step | stages | warps | fp16 dots | µs | KV GB/s | of read rate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ok = sorted((r for r in rows if "us" in r), key=lambda r: (r["kind"], r["us"]))
    for r in ok[:12]:
        t = r["tile"]
        lines.append(
            f"| {r['kind']} | {t['block_n']} | {t['num_stages']} | {t['num_warps']} | "
            f"{t['f16_dot']} | {r['us']:.0f} | {r['kv_gb_s']:.0f} | {r['of_read_rate']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = out_parser(__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.batch, args.context = 2, 64
    report = Report(args.out / "decode_tiles.json")
    report.record("device", run_info("name") if device == "cuda" else {"name": "cpu"})
    read = ceilings()["read_gb_s"] if device == "cuda" else 1.0
    report.record("read_gb_s", read)
    rows = sweep(args.batch, args.context, device, args.smoke, read)
    report.record("rows", rows)
    print(table(rows))


if __name__ == "__main__":
    main()
