"""Pipeline parallelism on the CPU: decode throughput at PP=2 against PP=1, and the bubble.

`python -m pdmesh.bench.pipeline_cpu [--batch 32] [--ctx 256]`, on the default model (fp32).
Engines in turn, on the same cores: PP=1 with torch's threads over every core; PP=1 on one
thread (what one core takes for the whole model); PP=2 (two ranks, one thread each) with one
batch in flight, where a stage computes its half of the model while the other waits; PP=2 with a
batch per stage in flight (the default), each of half the sequences; and the same with
`--partition` layers per stage. A stage's busy share is (one-thread time per token / 2) / PP=2
time per token; the rest is the bubble.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pdmesh.bench.gpu_workloads import prompts
from pdmesh.sampling_params import SamplingParams


def _decode_tokens_per_s(batch: int, ctx: int, steps: int, one_batch: bool, **layout: int) -> float:
    """Tokens per second of `batch` greedy sequences at about `ctx` tokens of context, over
    `steps` decode tokens each after 4 warm-up ones, counted as `LLMEngine.step` returns them."""
    from pdmesh import LLM

    tokens = batch * (ctx + steps + 64)
    with LLM(kv_cache_tokens=tokens, max_num_seqs=batch, **layout) as llm:
        engine = llm.engine
        if one_batch:
            engine.steps.max_in_flight = 1
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)
        for i, prompt in enumerate(prompts(batch, ctx, 7, engine.info.vocab_size)):
            engine.add_request(f"r{i}", prompt, params)
        made = 0
        while made < 4 * batch:  # the prompts, then 3 decode steps each
            made += len(engine.step())
        made, start = 0, time.perf_counter()
        while made < steps * batch:
            made += len(engine.step())
        return made / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--partition",
        default="19,11",
        help="layers per stage of a last run (PDMESH_PP_LAYER_PARTITION): the last stage also "
        "runs the LM head, which weighs about 8 of the default model's layers",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    run = (args.batch, args.ctx, args.steps)
    pp1 = _decode_tokens_per_s(*run, one_batch=True)
    torch.set_num_threads(1)
    one_core = _decode_tokens_per_s(*run, one_batch=True)
    torch.set_num_threads(cores)
    pp2_one = _decode_tokens_per_s(*run, one_batch=True, pipeline_parallel_size=2)
    pp2 = _decode_tokens_per_s(*run, one_batch=False, pipeline_parallel_size=2)
    os.environ["PDMESH_PP_LAYER_PARTITION"] = args.partition
    pp2_split = _decode_tokens_per_s(*run, one_batch=False, pipeline_parallel_size=2)
    result = {
        "device": f"{platform.processor() or platform.machine()}, {cores} cores",
        "torch": torch.__version__,
        **vars(args),
        "pp1_tokens_per_s": round(pp1, 1),
        "pp1_one_thread_tokens_per_s": round(one_core, 1),
        "pp2_one_batch_tokens_per_s": round(pp2_one, 1),
        "pp2_tokens_per_s": round(pp2, 1),
        "pp2_partitioned_tokens_per_s": round(pp2_split, 1),
        "pp2_one_batch_over_pp1": round(pp2_one / pp1, 3),
        "pp2_over_pp1": round(pp2 / pp1, 3),
        "pp2_partitioned_over_pp1": round(pp2_split / pp1, 3),
        # A stage's compute per token is half the one-thread model's: busy = 2 * rate / rate_1.
        "stage_busy_one_batch": round(pp2_one / (2 * one_core), 3),
        "stage_busy": round(pp2 / (2 * one_core), 3),
        "stage_busy_partitioned": round(pp2_split / (2 * one_core), 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
