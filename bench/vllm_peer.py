"""vLLM's CPU build as the offline bench's peer: a script run by path in a venv of its own.

It imports nothing of pdmesh (vLLM's venv has none). It reads a JSON job from the file named on
its command line — {"model", "prompts", "output_lens", "max_model_len", "memory_fraction"}, and
optionally "ignore_eos" (default true), "batch" (prompts submitted together, one group after
another; default all at once) and "speculative_config" (vLLM's dict) — runs the prompts through
`LLM.generate` (greedy, each its own max_tokens) after a warm-up, and prints one JSON line:
{"seconds", "output_tokens", "token_ids", "version"}. vLLM starts its engine in a spawned
process, hence the main guard.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    # vLLM's defaults but for the dtype, the length and its share of memory: on the CPU it
    # claims 92% of the machine by default and refuses to start when less is free.
    llm = LLM(
        job["model"],
        dtype="float32",
        max_model_len=job["max_model_len"],
        seed=0,
        gpu_memory_utilization=job["memory_fraction"],
        speculative_config=job.get("speculative_config"),
    )
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    ignore_eos = job.get("ignore_eos", True)
    batch = job.get("batch") or len(prompts)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)

    llm.generate(prompts[:2], [params(4), params(4)], use_tqdm=False)  # warm-up
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        lens = job["output_lens"][i : i + batch]
        group = llm.generate(prompts[i : i + batch], [params(n) for n in lens], use_tqdm=False)
        outputs += group
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
        "version": vllm.__version__,
    }
    print("PDMESH_PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
