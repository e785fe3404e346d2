"""Structured output's cost: time per output token with a JSON schema against unconstrained.

`python -m pdmesh.bench.structured_cpu [--batch 1 8] [--max-tokens 96]`, on the default model
(fp32, CPU). The same chat prompts asking for a JSON object are run unconstrained (ignore_eos,
so each makes max_tokens tokens) and under a JSON schema (the grammar ends the output when the
object closes). Time per output token (TPOT) of a request is (finished - first token) / (tokens
- 1), from `RequestOutput.metrics`; the figure is the mean over requests, per batch size (the
batch's requests are submitted together). The first constrained run compiles the schema; it is
run once before timing, as a served schema is compiled once and cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from typing import Any

import torch

from pdmesh.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "landmarks", "capital"],
}
CITIES = ("Paris", "Rome", "Madrid", "Berlin", "Lisbon", "Vienna", "Prague", "Oslo")


def _tpot(outputs: list[Any]) -> tuple[float, int]:
    """Mean seconds per output token after the first, and the tokens made."""
    per_request, tokens = [], 0
    for out in outputs:
        n = len(out.outputs[0].token_ids)
        tokens += n
        m = out.metrics
        if n > 1 and m is not None and m.first_token_time is not None and m.finished_time:
            per_request.append((m.finished_time - m.first_token_time) / (n - 1))
    return statistics.mean(per_request), tokens


def _run(llm: Any, batch: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    messages = [
        [{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as a JSON object."}]
        for i in range(batch)
    ]
    if constrained:
        so = StructuredOutputsParams(json=SCHEMA)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so)
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return _tpot(llm.chat(messages, params, use_tqdm=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from pdmesh import LLM

    rows = []
    with LLM(kv_cache_tokens=16384) as llm:
        _run(llm, 1, 8, constrained=True)  # compile the schema (cached from here on)
        for batch in args.batch:
            free, tight = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                free.append(_run(llm, batch, args.max_tokens, constrained=False))
                tight.append(_run(llm, batch, args.max_tokens, constrained=True))
            free_s = min(t for t, _ in free)
            tight_s = min(t for t, _ in tight)
            rows.append(
                {
                    "batch": batch,
                    "unconstrained_tpot_ms": round(free_s * 1e3, 2),
                    "json_schema_tpot_ms": round(tight_s * 1e3, 2),
                    "json_schema_tokens": tight[-1][1],
                    "ratio": round(tight_s / free_s, 3),
                }
            )
    result = {
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        **vars(args),
        "rows": rows,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
