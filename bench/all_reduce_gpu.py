"""The TP all-reduce's ways on two or more GPUs, by size, inside CUDA graphs as decode steps run
them: the one-shot kernel over symmetric memory (the engine's way, `one_shot_all_reduce_copy`),
the two-shot kernel on the same buffer, and NCCL.

    python -m torch.distributed.run --nproc-per-node 2 -m pdmesh.bench.all_reduce_gpu --out DIR

Each size is a decode batch's hidden states ([rows, 4096] bf16, the 8B shape): 64 all-reduces
a graph (two a layer, 32 layers), the graph replayed `--replays` times; µs per all-reduce is
the median replay's time / 64. Rank 0 writes DIR/all_reduce.json and prints a table. A way this
build lacks is reported as missing. Why: a TP=2 decode step of 512 sequences spends 2.5-3.6 ms
in its 64 one-shot all-reduces of 4 MiB (BENCHMARKS.md, issue 31).
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
from pdmesh.engine.parallel.symm_all_reduce import SymmetricAllReduce

HIDDEN = 4096
CALLS = 64  # a graph's all-reduces: two a layer, 32 layers


def _ways(fast: SymmetricAllReduce, group: object) -> dict[str, Callable[[torch.Tensor], object]]:
    def two_shot(x: torch.Tensor) -> torch.Tensor:
        shared = fast.buffer[: x.numel()]
        shared.copy_(x.reshape(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", fast.group_name)
        return shared

    def one_shot_copy(x: torch.Tensor) -> torch.Tensor:
        shared = fast.buffer[: x.numel()]
        return torch.ops.symm_mem.one_shot_all_reduce_copy(
            shared, x.reshape(-1), "sum", fast.group_name
        )

    return {
        "one_shot_copy": one_shot_copy,
        "two_shot": two_shot,
        "engine": fast,  # SymmetricAllReduce.__call__ as it is: two-shot from TWO_SHOT_BYTES on
        "nccl": lambda x: dist.all_reduce(x, group=group),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16,64,128,256,512")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    address = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    tp = init_group(rank, size, address, device, expert_parallel=False)
    rows = [int(r) for r in args.rows.split(",")]
    fast = SymmetricAllReduce(tp, max(rows) * HIDDEN, torch.bfloat16)
    results: dict[str, dict[str, float | str]] = {}
    for name, way in _ways(fast, tp.group).items():
        results[name] = {}
        for r in rows:
            x = torch.randn(r, HIDDEN, dtype=torch.bfloat16, device=device)
            try:
                us = replayed_us(partial(way, x), CALLS, args.replays, dist.barrier, graph=True)
                results[name][str(r)] = round(us, 2)
            except (RuntimeError, AttributeError) as e:  # a way this build lacks
                results[name][str(r)] = f"missing: {str(e).splitlines()[0][:120]}"
    if rank == 0:
        report = {"device": torch.cuda.get_device_name(device), "ranks": size,
                  "torch": torch.__version__, "hidden": HIDDEN, "dtype": "bfloat16",
                  "us_per_all_reduce": results}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "all_reduce.json").write_text(json.dumps(report, indent=2))
        print("| rows (x 4096 bf16) | " + " | ".join(results) + " |")
        print("| --- " * (len(results) + 1) + "|")
        for r in rows:
            print(f"| {r} | " + " | ".join(str(results[n][str(r)]) for n in results) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
