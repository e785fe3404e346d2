"""One DP=2 + EP=2 engine in a process of its own (its NCCL group lives until the process ends):
`python tests/gpu/dp_ep_child.py FOLDER DTYPE` prints a JSON line with the greedy tokens of
the prompts given on stdin (JSON), those of the first alone (the other replica idle), whether
both replicas replayed CUDA graphs and the exchange, steps launched ahead, whether the replicas
agreed through shared memory, and the seconds `close` took."""

from __future__ import annotations

import json
import sys
import time

from pdmesh import LLM, SamplingParams


def main() -> None:
    folder, dtype = sys.argv[1], sys.argv[2]
    prompts = json.loads(sys.stdin.read())
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM(folder, dtype=dtype, kv_cache_tokens=4096, data_parallel_size=2,
              enable_expert_parallel=True)  # fmt: skip
    runner = llm.engine.local.runner

    def tokens(ps: list[list[int]]) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return [o.outputs[0].token_ids for o in outputs]

    got, alone = tokens(prompts), tokens(prompts[:1])
    assert runner.dp is not None
    report = {
        "tokens": got,
        "alone": alone,
        "graphs": runner.graphs is not None,
        "gather_scatter": runner.dp.moe_all_reduce,
        "all_to_all": runner.dp.counters["all_to_all"],
        "per_replica": llm.engine.requests_per_replica,
        "launched_ahead": llm.engine.local.steps_launched_ahead,
        "host_max_shared": runner.dp.fast["host_max"].shared,
    }
    start = time.perf_counter()
    llm.close()
    report["close_s"] = time.perf_counter() - start
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
