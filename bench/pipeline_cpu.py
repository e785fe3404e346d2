"""Pipeline parallelism on the CPU: decode time per step at PP=2 against PP=1, and the bubble.

`python -m pdmesh.bench.pipeline_cpu [--batch 32] [--ctx 256]`, on the default model (fp32).
Three engines in turn, on the same cores: PP=1 with torch's threads over every core; PP=1 on one
thread (what one core takes for the whole model); PP=2 (two ranks, one thread each). One batch
is in flight at a time, so a stage computes its half of the model while the other waits: a
stage's busy share of a step is (one-thread step / 2) / PP=2 step, the rest is the bubble.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from pdmesh.bench.gpu_workloads import decode_step_time


def _step_ms(batch: int, ctx: int, steps: int, **layout: int) -> float:
    from pdmesh import LLM

    with LLM(kv_cache_tokens=batch * (ctx + steps + 64), max_num_seqs=batch, **layout) as llm:
        decode_step_time(llm.engine, batch, ctx, 2)  # warm-up
        return 1000 * decode_step_time(llm.engine, batch, ctx, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    run = (args.batch, args.ctx, args.steps)
    pp1 = _step_ms(*run)
    torch.set_num_threads(1)
    one_core = _step_ms(*run)
    torch.set_num_threads(cores)
    pp2 = _step_ms(*run, pipeline_parallel_size=2)
    busy = one_core / 2 / pp2
    result = {
        "device": f"{platform.processor() or platform.machine()}, {cores} cores",
        "torch": torch.__version__,
        **vars(args),
        "pp1_step_ms": round(pp1, 1),
        "pp1_one_thread_step_ms": round(one_core, 1),
        "pp2_step_ms": round(pp2, 1),
        "pp1_tokens_per_s": round(1000 * args.batch / pp1, 1),
        "pp2_tokens_per_s": round(1000 * args.batch / pp2, 1),
        "pp2_over_pp1": round(pp1 / pp2, 3),
        "stage_busy_share": round(busy, 3),
        "bubble_share": round(1 - busy, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
