"""vLLM's CPU build as the offline bench's peer: a script run by path in a venv of its own.

It imports nothing of pdmesh (vLLM's venv has none). It reads a JSON job from the file named on
its command line — {"model", "prompts", "output_lens", "max_model_len", "memory_fraction"} —
runs the prompts as one `LLM.generate` call (greedy, ignore_eos, each its own max_tokens) after
a warm-up, and prints one JSON line: {"seconds", "output_tokens", "token_ids", "version"}. vLLM
starts its engine in a spawned process, hence the main guard.
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
    )
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    llm.generate(prompts[:2], [params(4), params(4)], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, [params(n) for n in job["output_lens"]], use_tqdm=False)
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
