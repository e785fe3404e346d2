"""Batch prefills of the default model on the CPU: their time, the page faults they take, and
their rate against this machine's fp32 matrix-multiply rate measured in the same run.

    python -m pdmesh.bench.prefill_cpu [--batch 8] [--prompt-len 256] [--rounds 4]

`--batch` prompts of `--prompt-len` random token ids are prefilled together (one output token
each), once to warm up and then `--rounds` times, each timed with the minor page faults the
process took meanwhile and the time in each part of the forward (`parts_ms`, medians: the
projections, attention, norms, rotary with the KV store, and the rest, as `decode_step_cpu`
splits a decode step). The ceiling is oneDNN's rate on one layer's projections at the batch's
rows (weights packed, as the engine runs them), so the ratio is the share of the step's time the
projections' arithmetic would take at that rate. `PDMESH_KEEP_FREED_MEMORY=0` runs it with
glibc's default malloc (docs/gpu.md, CPU memory). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from pdmesh.bench.decode_step_cpu import kernel_parts


def matmul_rate(rows: int, shapes: list[tuple[int, int]], repeats: int = 3) -> float:
    """GFLOP/s of the packed oneDNN projections of `shapes` ([N, K] weights) at `rows` rows."""
    import torch

    from pdmesh.kernels.cpu.onednn_linear import linear

    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    inputs = {k: torch.randn(rows, k) for _, k in shapes}
    flops = sum(2 * rows * n * k for n, k in shapes)
    best = float("inf")
    for _ in range(repeats + 1):  # the first packs the weights
        start = time.perf_counter()
        for w in weights:
            linear(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def measure(batch: int, prompt_len: int, rounds: int) -> dict[str, object]:
    import torch

    from pdmesh import LLM, SamplingParams

    llm = LLM(kv_cache_tokens=max(4096, 2 * batch * prompt_len))
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    vocab = engine.info.vocab_size

    def prefill() -> tuple[float, int, dict[str, float]]:
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)]}
            for _ in range(batch)
        ]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with kernel_parts() as parts:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        parts["rest"] = seconds - sum(parts.values())
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, parts

    prefill()  # warm-up: kernels compiled, weights packed, the first activations allocated
    runs = [prefill() for _ in range(rounds)]
    # The projections' weights ([N, K]) of one layer, and their FLOPs for every prompt token.
    shapes = [
        tuple(m.weight.shape)
        for name, m in engine.runner.model.named_modules()
        if name.startswith("model.layers.0.")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
    ]
    layers = engine.info.num_layers
    tokens = batch * prompt_len
    flops = 2 * tokens * layers * sum(n * k for n, k in shapes)
    rate = matmul_rate(tokens, shapes)
    median = statistics.median(s for s, _, _ in runs)
    llm.close()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "seconds": [round(s, 3) for s, _, _ in runs],
        "page_faults": [f for _, f, _ in runs],
        "parts_ms": {
            part: round(statistics.median(p[part] for _, _, p in runs) * 1000, 1)
            for part in runs[0][2]
        },
        "median_s": round(median, 3),
        "tokens_per_s": round(tokens / median, 1),
        "projection_gflop": round(flops / 1e9, 1),
        "matmul_gflops": round(rate, 1),
        "share_of_ceiling": round(flops / 1e9 / rate / median, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    print(json.dumps(measure(args.batch, args.prompt_len, args.rounds)))


if __name__ == "__main__":
    main()
