"""A decode step of the default model on the CPU, and where it goes: the projections, the paged
decode attention, and the rest (norms, rotary, the KV store, the MLP's down projection, the LM
head, the host's step).

    python -m pdmesh.bench.decode_step_cpu [--batch 8] [--prompt-len 256] [--steps 60]

`--batch` requests of `--prompt-len` random token ids decode together (fp32, greedy); after 20
steps (the prefill among them), `--steps` are timed, each kernel wrapper's wall clock summed
(the projections: the `linear` kernel, which the MLP's down projection does not go through).
Prints JSON: milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pdmesh.bench.report import timed_into


def measure(batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    import pdmesh.kernels.cpu.paged_decode as paged_decode
    from pdmesh import LLM, SamplingParams
    from pdmesh.kernels import backend

    engine = LLM(kv_cache_tokens=max(32768, batch * (prompt_len + 20 + steps))).engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=20 + steps + 1, ignore_eos=True, temperature=0)
    for i in range(batch):
        prompt = [rng.randrange(100, engine.info.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(20):
        engine.step()
    totals = {"projections": 0.0, "attention": 0.0}
    backend._CPU["linear"] = timed_into(totals, "projections", backend._CPU["linear"])
    attend = paged_decode.paged_decode_attention
    paged_decode.paged_decode_attention = timed_into(totals, "attention", attend)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
    finally:
        paged_decode.paged_decode_attention = attend
    ms = {k: round(v / steps * 1000, 1) for k, v in totals.items()}
    step = round(elapsed / steps * 1000, 1)
    return {"batch": batch, "step_ms": step, **ms, "rest_ms": round(step - sum(ms.values()), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    print(json.dumps(measure(args.batch, args.prompt_len, args.steps)))


if __name__ == "__main__":
    main()
