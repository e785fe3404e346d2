"""Speculative decoding on the CPU: output tokens/s with n-gram speculation against without.

`python -m pdmesh.bench.speculative [--max-tokens 160] [--sweep 2 4 8 16 32]` (or `pdmesh
bench --speculative`), on the default model (fp32, CPU). The workload is input-grounded: chat
requests that hand the model a piece of Python code and ask it to rewrite, annotate or continue
it, so much of the answer is in the prompt. Greedy, EOS on (ignore_eos off: each request ends
where the model stops or at max_tokens); both runs produce the same tokens, which is checked.

- batch 1: the requests one after another; tokens/s = output tokens / wall time of them all.
- batch 32: 32 requests (the prompts repeated) submitted together, speculation with its default
  `disable_by_batch_size` (it stands aside at this size), and with it forced on.
- `--peer vllm`: the batch-1 and batch-32 cases on vLLM's CPU build too (offline.py's venv and
  peer script), with and without the same n-gram speculation, on the same prompt token ids; its
  greedy outputs are compared with pdmesh's.
- the sweep (`--sweep 1 2 4 8 16 32`): steady-state throughput at each batch size, every
  sequence running throughout (ignore_eos, 64 tokens each), speculation forced on
  (`disable_by_batch_size: null`) against off: where it stops paying is the threshold
  `SpeculativeConfig.disable_by_batch_size` defaults to.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch

from pdmesh.sampling_params import SamplingParams

SNIPPETS = (
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    ordered = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
""",
    """def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
""",
    """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
""",
)
TASKS = (
    "Rewrite this Python code with type hints, keeping everything else the same:",
    "Add a docstring to every function of this code and return the whole code:",
)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def conversations() -> list[list[dict[str, str]]]:
    """The 8 requests: every task on every snippet."""
    return [
        [{"role": "user", "content": f"{task}\n\n```python\n{code}```"}]
        for code in SNIPPETS
        for task in TASKS
    ]


def _run(llm: Any, convs: list[Any], batch: int, max_tokens: int) -> tuple[float, list[Any]]:
    """Wall seconds and outputs of `convs` in groups of `batch` submitted together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs: list[Any] = []
    start = time.perf_counter()
    for i in range(0, len(convs), batch):
        outs += llm.chat(convs[i : i + batch], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _measure(
    spec: dict[str, Any] | None, cases: list[tuple[str, int, int]], max_tokens: int
) -> dict[str, Any]:
    """One engine (speculation `spec`), each case (name, batch, requests): tokens/s."""
    from pdmesh import LLM

    llm = LLM(kv_cache_tokens=32768, speculative_config=spec)
    convs = conversations()
    _run(llm, convs[:1], 1, 8)  # warm-up
    figures: dict[str, Any] = {}
    for name, batch, requests in cases:
        work = [convs[i % len(convs)] for i in range(requests)]
        sp = llm.engine.speculator
        before = (sp.stats.proposed, sp.stats.accepted, sp.stats.verify_steps) if sp else None
        seconds, outs = _run(llm, work, batch, max_tokens)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        entry: dict[str, Any] = {
            "batch": batch,
            "requests": requests,
            "output_tokens": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2),
            "token_ids": [o.outputs[0].token_ids for o in outs],
            "prompt_token_ids": [o.prompt_token_ids for o in outs],
        }
        if sp is not None and before is not None:
            proposed = sp.stats.proposed - before[0]
            accepted = sp.stats.accepted - before[1]
            entry["proposed"], entry["accepted"] = proposed, accepted
            entry["acceptance_rate"] = round(accepted / proposed, 3) if proposed else 0.0
            entry["verify_steps"] = sp.stats.verify_steps - before[2]
        figures[name] = entry
    llm.close()
    return figures


def steady_sweep(sizes: list[int], tokens: int = 64) -> list[dict[str, Any]]:
    """Throughput at each batch size with every sequence running throughout (ignore_eos, fixed
    `tokens` each: no tail), speculation forced on against off, the two engines alternating
    per size: where the ratio falls below 1 is the stand-aside threshold."""
    from pdmesh import LLM

    always = {**NGRAM, "disable_by_batch_size": None}
    engines = {
        "off": LLM(kv_cache_tokens=32768),
        "on": LLM(kv_cache_tokens=32768, speculative_config=always),
    }
    convs = conversations()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rows = []
    for b in sizes:
        work = [convs[i % len(convs)] for i in range(b)]
        rate = {}
        for name, llm in engines.items():
            llm.chat(work[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
            start = time.perf_counter()
            llm.chat(work, params, use_tqdm=False)
            rate[name] = b * tokens / (time.perf_counter() - start)
        rows.append(
            {
                "batch": b,
                "off_tokens_per_s": round(rate["off"], 2),
                "spec_tokens_per_s": round(rate["on"], 2),
                "speedup": round(rate["on"] / rate["off"], 3),
            }
        )
        print(rows[-1], flush=True)
    for llm in engines.values():
        llm.close()
    return rows


def vllm_rows(
    venv: str, max_tokens: int, off: dict[str, Any], on: dict[str, Any], cores: str = "all"
) -> list[dict[str, Any]]:
    """Each case on vLLM's CPU build without and with NGRAM (its names are vLLM's), against
    pdmesh's figures for the same case (`off`, `on`: `_measure`'s); cores: offline.vllm_env."""
    from pathlib import Path

    from pdmesh.bench.offline import Workload, run_vllm, vllm_python
    from pdmesh.checkpoint.source import resolve_model_folder

    python = vllm_python(Path(venv).expanduser())
    folder = str(resolve_model_folder(None))
    rows = []
    for name, ours in off.items():
        prompts = ours["prompt_token_ids"]
        work = Workload(prompts, [max_tokens] * len(prompts))
        runs = {
            mode: run_vllm(
                python,
                folder,
                work,
                cores,
                ignore_eos=False,
                batch=ours["batch"],
                speculative_config=spec,
            )
            for mode, spec in (("off", None), ("ngram", NGRAM))
        }
        rate = {m: r["output_tokens"] / r["seconds"] for m, r in runs.items()}
        row: dict[str, Any] = {
            "case": name,
            "vllm_version": runs["off"]["version"],
            "vllm_off_tokens_per_s": round(rate["off"], 2),
            "vllm_ngram_tokens_per_s": round(rate["ngram"], 2),
            "pdmesh_off_tokens_per_s": ours["tokens_per_s"],
            "pdmesh_ngram_tokens_per_s": on[name]["tokens_per_s"],
        }
        row["off_pdmesh_over_vllm"] = round(row["pdmesh_off_tokens_per_s"] / rate["off"], 3)
        row["ngram_pdmesh_over_vllm"] = round(row["pdmesh_ngram_tokens_per_s"] / rate["ngram"], 3)
        for mode, r in runs.items():
            same = sum(a == b for a, b in zip(ours["token_ids"], r["token_ids"], strict=True))
            row[f"identical_{mode}"] = f"{same}/{len(prompts)}"
        rows.append(row)
        print(row, flush=True)
    return rows


def run(
    max_tokens: int,
    sweep: list[int],
    draft: str | None = None,
    peer_venv: str | None = None,
    peer_cores: str = "all",
) -> dict[str, Any]:
    """draft: also batch 1 with this draft model ("default": the default model itself, an
    exactness check that cannot be faster: it costs the target's forward again per draft).
    peer_venv: also the cases on vLLM's CPU build from this venv (`vllm_rows`), with
    `peer_cores` (offline.vllm_env)."""
    cases = [("batch1", 1, 8), ("batch32", 32, 32)]
    off = _measure(None, cases, max_tokens)
    on = _measure(NGRAM, cases, max_tokens)
    forced = _measure({**NGRAM, "disable_by_batch_size": None}, cases[1:], max_tokens)
    runs = [(c[0], "ngram", on) for c in cases]
    runs += [(c[0], "ngram, always on", forced) for c in cases[1:]]
    if draft is not None:
        from pdmesh.checkpoint.source import resolve_model_folder

        path = str(resolve_model_folder(None)) if draft == "default" else draft
        drafted = _measure({"model": path, "num_speculative_tokens": 4}, cases[:1], max_tokens)
        runs.append(("batch1", f"draft model {draft}", drafted))
    rows = []
    for name, mode, figures in runs:
        a, b = off[name], figures[name]
        rows.append(
            {
                "case": name,
                "mode": mode,
                "batch": a["batch"],
                "off_tokens_per_s": a["tokens_per_s"],
                "spec_tokens_per_s": b["tokens_per_s"],
                "speedup": round(b["tokens_per_s"] / a["tokens_per_s"], 3),
                "acceptance_rate": b.get("acceptance_rate"),
                "output_tokens": b["output_tokens"],
                "identical": a["token_ids"] == b["token_ids"],
            }
        )
    return {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "max_tokens": max_tokens,
        "speculative_config": NGRAM,
        "rows": rows,
        "steady_sweep": steady_sweep(sweep) if sweep else [],
        "vllm": vllm_rows(peer_venv, max_tokens, off, on, peer_cores) if peer_venv else [],
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{'case':9} {'mode':22} {'off tok/s':>9} {'spec tok/s':>10} {'x':>6} {'accept':>6} same")
    for r in result["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(
            f"{r['case']:9} {r['mode']:22} {r['off_tokens_per_s']:9.2f} "
            f"{r['spec_tokens_per_s']:10.2f} {r['speedup']:6.2f} {acc:>6} {r['identical']}"
        )
    for r in result["vllm"]:
        print(
            f"{r['case']:9} vLLM {r['vllm_version']}: off {r['vllm_off_tokens_per_s']:.2f} tok/s "
            f"(pdmesh / vLLM {r['off_pdmesh_over_vllm']:.2f}x, same {r['identical_off']}), "
            f"n-gram {r['vllm_ngram_tokens_per_s']:.2f} tok/s (pdmesh / vLLM "
            f"{r['ngram_pdmesh_over_vllm']:.2f}x, same {r['identical_ngram']})"
        )


def run_speculative_bench(args: argparse.Namespace) -> int:
    """`pdmesh bench --speculative`."""
    venv = args.peer_venv if args.peer == "vllm" and not args.skip_peer else None
    result = run(
        args.max_tokens or 160, list(args.sweep or ()), args.draft_model, venv, args.peer_cores
    )
    print_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["identical"] for r in result["rows"]) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--sweep", type=int, nargs="*", default=[])
    p.add_argument("--draft-model", default=None, help="also a draft model (default: itself)")
    p.add_argument("--json-out", default=None)
    raise SystemExit(run_speculative_bench(p.parse_args()))


if __name__ == "__main__":
    main()
