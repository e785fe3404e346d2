"""One MoE layer's routing and experts at decode batch sizes, before and after the small-kernel
work (issues 30 and 34): what each costs on one GPU and on one rank of expert parallelism.

    python -m pdmesh.bench.moe_layer_gpu --out DIR
    python -m pdmesh.bench.moe_layer_gpu --out DIR --sweep    # the GEMV kernels' launch shapes
    TRITON_INTERPRET=1 python -m pdmesh.bench.moe_layer_gpu --out DIR --tiny   # a CPU dry run

Qwen3-30B-A3B's MoE layer (128 experts, top 8, hidden 2048, intermediate 768, bf16). For each
batch of T tokens:
- experts alone, the grouped GEMMs (alignment, two GEMMs, combine: 6 kernels) against the GEMV
  kernels (2), to place the switch between them (`moe_gemv.MAX_TOKENS`);
- the layer's routing and experts as the engine ran them before (softmax/top-k, then the counts
  as zeros, ones, scatter-add and a sum; under EP the slot mapping, four more ops, and the slot
  counts) and as it runs them now (one routing kernel that maps and counts, then the experts).
"one GPU" holds all 128 experts; "EP=2 rank" holds 64 (experts 0..63, pairs of the others skipped),
as rank 0 of EP=2 runs it. Each figure is one call's share of a CUDA graph that walks the layer
over copies of the weights (together far beyond L2, as a decode step's layers are); the floor is
the held experts the batch touches, their bytes over the copy bandwidth measured in the same run.
Every path's output is checked against the torch reference first. Writes DIR/moe-layer.json and
prints a table. `--sweep` times the up and the down GEMV kernel alone at 1-8 tokens over a grid of
launch shapes (each checked first), for `moe_gemv.default_config` (DIR/moe-gemv-sweep.json).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pdmesh.bench.kernel_cases import rel_err
from pdmesh.bench.report import Report, ceilings, free_memory, median_s, out_parser, run_info

QWEN3_30B = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
TINY = {"experts": 8, "top_k": 2, "hidden": 64, "inter": 32}
TOKENS = (1, 2, 4, 8, 12, 16, 32, 64)


def _count_before(counts: torch.Tensor, ids: torch.Tensor) -> None:
    # The engine's counting before: a fresh zeros, ones, a scatter-add and an in-place sum.
    flat = ids.flatten()
    fresh = torch.zeros(counts.shape[0], dtype=torch.int64, device=ids.device)
    counts += fresh.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


class Layer:
    """A layer's weights (copies), counters and slot tables on one rank."""

    def __init__(self, shape: dict[str, int], held: int, copies: int, device: str) -> None:
        e, h, i = shape["experts"], shape["hidden"], shape["inter"]
        self.shape, self.held, self.device = shape, held, device
        dt = torch.bfloat16 if device == "cuda" else torch.float32
        self.w13 = [
            torch.randn(held, 2 * i, h, device=device, dtype=dt) / h**0.5 for _ in range(copies)
        ]
        self.w2 = [torch.randn(held, h, i, device=device, dtype=dt) / i**0.5 for _ in range(copies)]
        self.counts = torch.zeros(e, dtype=torch.int64, device=device)
        self.slot_counts = torch.zeros(e, dtype=torch.int64, device=device)
        self.log2phy = torch.arange(e, device=device).unsqueeze(1).repeat(1, e)  # no replicas
        self.replicas = torch.ones(e, dtype=torch.int64, device=device)
        self.dtype = dt

    @property
    def ep(self) -> bool:
        return self.held < self.shape["experts"]

    def before(self, x: torch.Tensor, logits: torch.Tensor, copy: int) -> torch.Tensor:
        from pdmesh.kernels.moe import SlotTable
        from pdmesh.kernels.triton import moe_experts, moe_route

        r = moe_route.moe_route(logits, self.shape["top_k"], True)
        _count_before(self.counts, r.ids)
        slots = r.ids
        if self.ep:  # ExpertMap.physical, as it was
            t = SlotTable(self.log2phy, self.replicas, 0)
            token = torch.arange(0, r.ids.shape[0], device=r.ids.device)
            slots = t.log2phy[r.ids, token[:, None] % t.replicas[r.ids]]
            _count_before(self.slot_counts, slots)
        w13, w2 = self.w13[copy], self.w2[copy]
        return moe_experts.moe_experts_grouped(x, w13, w2, r.weights, slots, 0)

    def after(self, x: torch.Tensor, logits: torch.Tensor, copy: int) -> torch.Tensor:
        from pdmesh.kernels import RouteTally, SlotTable, moe_experts, moe_route

        n = x.shape[0]
        if self.ep:
            table = SlotTable(self.log2phy, self.replicas, 0)
            tally = RouteTally(0, n, self.counts, self.slot_counts)
        else:
            table, tally = None, RouteTally(0, n, self.counts)
        r = moe_route(logits, self.shape["top_k"], True, table, tally)
        return moe_experts(x, self.w13[copy], self.w2[copy], r.weights, r.slots, 0)


def per_call_us(fn: Callable[[int], object], copies: int, cuda: bool) -> float:
    """Microseconds per call, from a CUDA graph of one call per weight copy (CPU: eager)."""
    for c in range(min(2, copies)):
        fn(c)  # compile outside the capture
    if not cuda:
        start = time.perf_counter()
        for c in range(copies):
            fn(c)
        return (time.perf_counter() - start) * 1e6 / copies
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(copies):
            fn(c)
    return median_s(graph.replay, warmup=10, rep=100) * 1e6 / copies


def measure(layer: Layer, tokens: int, bw: float, cuda: bool) -> dict[str, Any]:
    from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
    from pdmesh.kernels.triton.moe_experts import moe_experts_grouped
    from pdmesh.kernels.triton.moe_gemv import moe_experts_gemv

    s, copies = layer.shape, len(layer.w13)
    g = torch.Generator(device=layer.device).manual_seed(tokens)
    x = torch.randn(tokens, s["hidden"], device=layer.device, generator=g).to(layer.dtype)
    logits = [
        torch.randn(tokens, s["experts"], device=layer.device, generator=g).to(layer.dtype)
        for _ in range(copies)
    ]
    routed = [moe_route_ref(lg.float(), s["top_k"], True) for lg in logits]
    w, ids = routed[0].weights, routed[0].ids
    ref = moe_experts_ref(x, layer.w13[0], layer.w2[0], w, ids, 0)
    errors = {
        "grouped": rel_err(moe_experts_grouped(x, layer.w13[0], layer.w2[0], w, ids, 0), ref),
        "gemv": rel_err(moe_experts_gemv(x, layer.w13[0], layer.w2[0], w, ids, 0), ref),
    }
    if not max(errors.values()) < 2e-2:
        return {"tokens": tokens, "error": f"wrong result: {errors}"}
    held = sorted({int(e) for r in routed for e in r.ids.flatten() if int(e) < layer.held})
    expert_bytes = layer.w13[0][0].nbytes + layer.w2[0][0].nbytes
    touched = (
        sum(len({int(e) for e in r.ids.flatten() if int(e) < layer.held}) for r in routed) / copies
    )
    floor_us = touched * expert_bytes / bw * 1e6

    def experts(fn: Callable[..., torch.Tensor]) -> Callable[[int], object]:
        def run(c: int) -> object:
            r = routed[c]
            return fn(x, layer.w13[c], layer.w2[c], r.weights, r.ids, 0)

        return run

    figures = {
        "experts_grouped_us": per_call_us(experts(moe_experts_grouped), copies, cuda),
        "experts_gemv_us": per_call_us(experts(moe_experts_gemv), copies, cuda),
        "layer_before_us": per_call_us(lambda c: layer.before(x, logits[c], c), copies, cuda),
        "layer_after_us": per_call_us(lambda c: layer.after(x, logits[c], c), copies, cuda),
    }
    return {
        "tokens": tokens,
        "held_experts_touched": touched,
        "distinct_held": len(held),
        "floor_us": floor_us,
        **figures,
        "rel_err": errors,
    }


UP_SHAPES = [(n, k, w) for n in (4, 8, 16) for k in (256, 512, 1024) for w in (4, 8)]
DOWN_SHAPES = [(n, k, w) for n in (4, 8, 16) for k in (64, 128, 256) for w in (2, 4, 8)]


def sweep(layer: Layer, tokens: int, cuda: bool) -> dict[str, Any]:
    """µs of the up and of the down kernel alone for each launch shape (wrong results dropped)."""
    from pdmesh.kernels.moe import moe_experts_ref, moe_route_ref
    from pdmesh.kernels.triton.moe_gemv import (
        default_config,
        down_projection,
        moe_experts_gemv,
        up_projection,
    )

    s, copies = layer.shape, len(layer.w13)
    g = torch.Generator(device=layer.device).manual_seed(tokens)
    x = torch.randn(tokens, s["hidden"], device=layer.device, generator=g).to(layer.dtype)
    routed = [
        moe_route_ref(
            torch.randn(tokens, s["experts"], device=layer.device, generator=g), s["top_k"], True
        )
        for _ in range(copies)
    ]
    base = default_config(s["hidden"], s["inter"])
    ref = moe_experts_ref(x, layer.w13[0], layer.w2[0], routed[0].weights, routed[0].ids, 0)
    hs = [up_projection(x, layer.w13[c], routed[c].ids, 0, None, base) for c in range(copies)]
    result: dict[str, Any] = {"tokens": tokens, "up": [], "down": []}
    defaults = {
        "up": (base.up_block_n, base.up_block_k, base.up_warps),
        "down": (base.down_block_n, base.down_block_k, base.down_warps),
    }
    for part, shapes in (("up", UP_SHAPES), ("down", DOWN_SHAPES)):
        tried = shapes if cuda else shapes[:2]  # CPU: a dry run
        for n, k, w in [defaults[part], *[t for t in tried if t != defaults[part]]]:
            if part == "up":
                cfg = base._replace(up_block_n=n, up_block_k=k, up_warps=w)
            else:
                cfg = base._replace(down_block_n=n, down_block_k=k, down_warps=w)
            r = routed[0]
            out = moe_experts_gemv(x, layer.w13[0], layer.w2[0], r.weights, r.ids, 0, config=cfg)
            err = rel_err(out, ref)
            if not err < 2e-2:
                result[part].append({"shape": (n, k, w), "error": f"wrong result: {err:.3g}"})
                continue

            def run(c: int, cfg=cfg, part=part) -> object:
                r = routed[c]
                if part == "up":
                    return up_projection(x, layer.w13[c], r.ids, 0, None, cfg)
                return down_projection(
                    hs[c], layer.w2[c], r.weights, r.ids, 0, None, cfg, layer.dtype
                )

            result[part].append({"shape": (n, k, w), "us": per_call_us(run, copies, cuda)})
    for part in ("up", "down"):
        timed = [t for t in result[part] if "us" in t]
        result[f"best_{part}"] = min(timed, key=lambda t: t["us"])
        result[f"default_{part}"] = result[part][0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a dry run)")
    parser.add_argument("--sweep", action="store_true", help="the GEMV kernels' launch shapes")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ["PDMESH_KERNEL_BACKEND"] = "triton"
        if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
            raise SystemExit("--tiny: set TRITON_INTERPRET=1 before starting Python")
    cuda = not args.tiny
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else QWEN3_30B
    c = ceilings() if cuda else {"copy_gb_s": 1.0}
    bw = c["copy_gb_s"] * 1e9
    name = "moe-gemv-sweep.json" if args.sweep else "moe-layer.json"
    report = Report(args.out / name, indent=1, **run_info(), ceilings=c, shape=shape)
    if args.sweep:
        for mode, held in (("one GPU", shape["experts"]), ("EP=2 rank", shape["experts"] // 2)):
            layer = Layer(shape, held, copies=2 if args.tiny else 4, device=device)
            for t in (1, 2) if args.tiny else (1, 2, 4, 8):
                r = sweep(layer, t, cuda)
                report.append(mode, r)
                print(
                    f"{mode} T={t}: up default {r['default_up']['us']:.1f} best "
                    f"{r['best_up']['us']:.1f} {r['best_up']['shape']}; down default "
                    f"{r['default_down']['us']:.1f} best {r['best_down']['us']:.1f} "
                    f"{r['best_down']['shape']}",
                    flush=True,
                )
            del layer
            free_memory()
        return 0
    tokens = (1, 3, 9) if args.tiny else TOKENS
    for name, held in (("one GPU", shape["experts"]), ("EP=2 rank", shape["experts"] // 2)):
        layer = Layer(shape, held, copies=2 if args.tiny else 4, device=device)
        print(f"{name}: T | floor | experts grouped / gemv | layer before / after (us)")
        for t in tokens:
            r = measure(layer, t, bw, cuda)
            report.append(name, r)
            if "error" in r:
                print(f"  {t:3d} {r['error']}", flush=True)
                continue
            print(
                f"  {t:3d} | {r['floor_us']:6.1f} | {r['experts_grouped_us']:6.1f} / "
                f"{r['experts_gemv_us']:6.1f} | {r['layer_before_us']:6.1f} / "
                f"{r['layer_after_us']:6.1f}",
                flush=True,
            )
        del layer
        free_memory()
    print(f"copy {c['copy_gb_s']:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
