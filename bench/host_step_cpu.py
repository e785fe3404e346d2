"""The host's work in a decode step of many sequences, on the CPU: what rank 0's Python costs
per step beside the forward (on a GPU it must fit in the step's device time, or the GPU waits).

    python -m pdmesh.bench.host_step_cpu [--seqs 512] [--steps 100] [--runs 3]

A tiny Llama (random bf16-shaped weights, float32 on the CPU) with `--seqs` sequences of 40-token
prompts decoding together, steps launched ahead (`async_scheduling=True`, as on GPUs with CUDA
graphs). Each part of `LLMEngine.step` is timed per step: the scheduler's lookahead (the next
step's slots), `ModelRunner.prepare` (its inputs), the forward, sampling, and handling the
previous step's tokens. Prints JSON: milliseconds per step, median over `--runs`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdmesh.bench.gpu_models import TINY, llama_8b_config, save_word_tokenizer, write_config
from pdmesh.bench.report import timed_into

PARTS = {
    "lookahead": ("scheduler", "schedule_lookahead"),
    "prepare": ("runner", "prepare"),
    "forward": ("runner", "forward_with_plan"),
    "sample": ("sampler", "sample"),
    "handle": ("engine", "_handle"),
}


def one_run(folder: Path, seqs: int, steps: int) -> dict[str, float]:
    from pdmesh import LLM, SamplingParams

    llm = LLM(str(folder), device="cpu", load_format="dummy", skip_tokenizer_init=True,
              kv_cache_tokens=seqs * 400, max_num_seqs=seqs, max_num_batched_tokens=8192,
              async_scheduling=True)  # fmt: skip
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", [rng.randrange(100, 500) for _ in range(40)], params)
    for _ in range(16):  # prompts prefilled, steps launched ahead
        engine.step()
    owners = {
        "scheduler": engine.scheduler,
        "runner": engine.runner,
        "sampler": engine.runner.step_sampler,
        "engine": engine,
    }
    spent = dict.fromkeys(PARTS, 0.0)

    for part, (owner, name) in PARTS.items():
        setattr(owners[owner], name, timed_into(spent, part, getattr(owners[owner], name)))
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    out = {part: 1e3 * s / steps for part, s in spent.items()}
    out["step"] = 1e3 * total / steps
    out["host"] = out["lookahead"] + out["prepare"] + out["handle"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    config = llama_8b_config()
    config.update({**TINY, "max_position_embeddings": 1024})
    folder = write_config(Path(tempfile.mkdtemp()) / "tiny", config)
    save_word_tokenizer(folder, config.vocab_size)
    runs = [one_run(folder, args.seqs, args.steps) for _ in range(args.runs)]
    median = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps({"seqs": args.seqs, "steps": args.steps, "ms_per_step": median}))


if __name__ == "__main__":
    main()
