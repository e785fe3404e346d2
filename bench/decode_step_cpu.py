"""A decode step of the default model on the CPU, and where it goes: the projections (plain, and
the MLP's down projection with its SiLU-and-mul), the paged decode attention, the norms, the
rotary embedding with the KV store (one kernel), and the rest (the host's step, module calls,
sampling).

    python -m pdmesh.bench.decode_step_cpu [--batch 8] [--prompt-len 256] [--steps 60]
        [--temperature 0] [--top-p 1]

`--batch` requests of `--prompt-len` random token ids decode together (fp32; greedy unless
`--temperature` / `--top-p` say otherwise, which time the sampler too); after 20
steps (the prefill among them), `--steps` are timed, each CPU kernel's wall clock summed (the
kernels as `backend.pick` hands them out). Prints JSON: milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pdmesh.bench.report import timed_into

# The CPU kernels timed (backend's names) and the part of the step each counts towards.
PARTS = {
    "linear": "projections",
    "silu_and_mul_linear": "gated_projection",
    "paged_decode_attention": "attention",
    "paged_prefill_attention": "attention",
    "fused_add_rms_norm": "norms",
    "rms_norm": "norms",
    "rotary_and_store_kv": "rotary_and_kv_store",
}


@contextmanager
def kernel_parts() -> Iterator[dict[str, float]]:
    """Seconds spent in each part (PARTS) while the block runs: every CPU kernel of PARTS is
    wrapped in a wall clock (`backend.cpu_kernels_wrapped`)."""
    from pdmesh.kernels import backend

    totals = dict.fromkeys(PARTS.values(), 0.0)
    with backend.cpu_kernels_wrapped(lambda name, fn: timed_into(totals, PARTS[name], fn), PARTS):
        yield totals


def measure(
    batch: int, prompt_len: int, steps: int, temperature: float = 0.0, top_p: float = 1.0
) -> dict[str, float]:
    from pdmesh import LLM, SamplingParams

    engine = LLM(kv_cache_tokens=max(32768, batch * (prompt_len + 20 + steps))).engine
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=20 + steps + 1, ignore_eos=True, temperature=temperature, top_p=top_p
    )
    for i in range(batch):
        prompt = [rng.randrange(100, engine.info.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(20):
        engine.step()
    with kernel_parts() as totals:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
    ms = {k: round(v / steps * 1000, 1) for k, v in totals.items()}
    step = round(elapsed / steps * 1000, 1)
    return {"batch": batch, "step_ms": step, **ms, "rest_ms": round(step - sum(ms.values()), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args()
    figures = measure(args.batch, args.prompt_len, args.steps, args.temperature, args.top_p)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
