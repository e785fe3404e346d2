"""Expert parallelism's token exchange on two or more GPUs, the candidates side by side (issue
30): what one MoE layer's dispatch and combine cost at the Qwen3-30B-A3B shape, by tokens a rank.

    python -m torch.distributed.run --nproc-per-node 2 -m pdmesh.bench.moe_exchange_gpu --out DIR

Each rank holds `tokens` rows of hidden 2048 (bf16), each routed to 8 experts:
- `all_reduce`: the engine's exchange on GPUs today: every rank computes its experts' part of
  every token, one all-reduce of [tokens x ranks, 2048] sums the parts (the engine's own
  all-reduce: symmetric memory, one- or two-shot by size), in a CUDA graph;
- `all_to_all_fixed`: dispatch and combine as two NCCL `all_to_all_single` of fixed capacity
  (every rank sends `tokens x 8` rows to every other: the most it could, so no host sync sizes
  them), in a CUDA graph;
- `all_to_all_sized`: the same with each destination's real share (tokens x 8 / ranks rows),
  sizes known on the host, eager: what a graph cannot replay;
µs per layer (dispatch + combine), the median of `--replays`, 48 layers' worth a graph. Rank 0
writes DIR/moe_exchange.json and prints a table. `--cpu`: a dry run over gloo, no graphs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from pdmesh.bench.report import replayed_us
from pdmesh.engine.parallel.comm import init_group
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.symm_all_reduce import symmetric_all_reduce

HIDDEN, TOP_K, LAYERS = 2048, 8, 48


def _ways(tp: ParallelGroup, tokens: int) -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (one layer's exchange, capturable in a CUDA graph)."""
    n, dev, dtype = (
        tp.size,
        tp.device,
        torch.bfloat16 if tp.device.type == "cuda" else torch.float32,
    )
    parts = torch.randn(tokens * n, HIDDEN, dtype=dtype, device=dev)
    fixed_in = torch.randn(n * tokens * TOP_K, HIDDEN, dtype=dtype, device=dev)
    fixed_out = torch.empty_like(fixed_in)
    share = tokens * TOP_K // n
    sized_in = torch.randn(n * share, HIDDEN, dtype=dtype, device=dev)
    sized_out = torch.empty_like(sized_in)

    def all_reduce() -> object:
        return tp.all_reduce(parts.clone())

    def all_to_all_fixed() -> None:
        dist.all_to_all_single(fixed_out, fixed_in, group=tp.group)  # dispatch
        dist.all_to_all_single(fixed_in, fixed_out, group=tp.group)  # combine

    def all_to_all_sized() -> None:
        splits = [share] * n  # as a host would learn them from the routing
        dist.all_to_all_single(sized_out, sized_in, splits, splits, group=tp.group)
        dist.all_to_all_single(sized_in, sized_out, splits, splits, group=tp.group)

    return {
        "all_reduce": (all_reduce, True),
        "all_to_all_fixed": (all_to_all_fixed, True),
        "all_to_all_sized": (all_to_all_sized, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="1,8,32,64,256")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="a dry run over gloo")
    args = parser.parse_args()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    address = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    tp = init_group(rank, size, address, device, expert_parallel=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    if not args.cpu:
        fast = symmetric_all_reduce(tp, max(tokens) * size * HIDDEN, torch.bfloat16)
        if fast is not None:
            tp.fast["all_reduce"] = fast
    results: dict[str, dict[str, float | str]] = {}
    for t in tokens:
        for name, (layer, graph) in _ways(tp, t).items():
            try:
                barrier = partial(dist.barrier, group=tp.host_group)
                us = round(replayed_us(layer, LAYERS, args.replays, barrier, graph), 1)
                results.setdefault(name, {})[str(t)] = us
            except RuntimeError as e:  # a way this build or backend lacks
                results.setdefault(name, {})[str(t)] = f"failed: {str(e).splitlines()[0][:100]}"
    if rank == 0:
        name = "cpu" if args.cpu else torch.cuda.get_device_name(device)
        report = {"device": name, "ranks": size, "torch": torch.__version__, "hidden": HIDDEN,
                  "top_k": TOP_K, "us_per_layer": results}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_exchange.json").write_text(json.dumps(report, indent=2))
        print("| tokens a rank | " + " | ".join(results) + " |")
        print("| --- " * (len(results) + 1) + "|")
        for t in tokens:
            print(f"| {t} | " + " | ".join(str(results[n].get(str(t))) for n in results) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
