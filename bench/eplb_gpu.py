"""EPLB on two GPUs: a skewed-routing MoE at EP=2, the busiest rank's expert load against the
mean, tokens/s and the decode steps' time (every rank's step ends at the slowest rank's pace),
with EPLB off and on.

    python -m pdmesh.bench.eplb_gpu --out DIR [--prompts 256] [--max-tokens 64] [--tiny]

The model is `eplb_cpu.make_moe`'s random Qwen3-MoE at a GPU's scale (`SHAPE`: 64 experts, top
8, bf16), whose router favours top-k experts held only by rank 0 at start (the constant component
of every token's embedding, see make_moe): before any rebalancing the experts are split in order
and the redundant slots, on the last rank, copy experts 0, 1, ..., so the hot ones come after
those. Engines in turn on the same two GPUs, greedy, the same prompts, through `LLM.generate`:
EPLB off, then on (rebalancing every `--interval` steps), the pair `--repeats` times after a pair
not counted (the first process compiles the Triton kernels into the cache the others read: it ran
at a sixth of the others' rate). Each engine runs in a process of its own (a second engine with
TP graphs in one process hangs on GPUs: symmetric memory is registered once per process);
medians reported.
`--tiny`: a dry run on the CPU with small shapes.
Writes DIR/eplb.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.eplb_cpu import make_moe, run_engine

# Qwen3-30B-A3B's expert width and routing (8 of its 128 experts per token) on 64 experts and 8
# layers, so that the model is written in seconds; its attention is narrower.
SHAPE = dict(hidden=2048, heads=16, kv_heads=4, layers=8, experts=64, top_k=8,
             moe_intermediate=768, vocab=32000)  # fmt: skip
TINY_SHAPE = dict(hidden=128, heads=4, kv_heads=4, layers=3, experts=8, top_k=2,
                  moe_intermediate=64, vocab=512)  # fmt: skip


def _in_process_of_its_own(folder: Path, work: Path, options: dict[str, Any]) -> dict:
    out = work.with_name("result.json")
    argv = [sys.executable, "-m", "pdmesh.bench.eplb_gpu", "--one", str(folder), "--work",
            str(work), "--options", json.dumps(options), "--out", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, timeout=600)
    return json.loads(out.read_text())


def _one(args: argparse.Namespace) -> None:
    work = json.loads(args.work.read_text())
    options = json.loads(args.options)
    result = run_engine(
        Path(args.one), work["prompts"], work["max_tokens"], step_times=True, **options
    )
    args.out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--interval", type=int, default=16)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--anchor", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a dry run on the CPU, small shapes")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a model folder: one engine, here
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args)
        return
    import torch

    shape = TINY_SHAPE if args.tiny else SHAPE
    if args.tiny:
        args.prompts, args.prompt_len, args.max_tokens, args.interval = 8, 32, 12, 4
    rng = random.Random(0)
    prompts = [
        [rng.randrange(shape["vocab"]) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    device = "cpu" if args.tiny else "cuda"
    engine = dict(tensor_parallel_size=2, enable_expert_parallel=True, device=device,
                  dtype="float32" if args.tiny else "bfloat16", kv_cache_tokens=1 << 17,
                  max_model_len=args.prompt_len + args.max_tokens + 16)  # fmt: skip
    eplb = dict(enable_eplb=True, num_redundant_experts=args.redundant,
                eplb_window_size=args.interval, eplb_step_interval=args.interval)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        hot = tuple(range(args.redundant, args.redundant + shape["top_k"]))
        per_rank = (shape["experts"] + args.redundant) // 2  # slots; rank 0 holds experts 0..
        assert hot[-1] < per_rank, "the hot experts must all start on rank 0"
        folder = make_moe(Path(tmp), **shape, skew=args.skew, anchor=args.anchor, hot=hot,
                          dtype=None if args.tiny else "bfloat16")  # fmt: skip
        made_s = time.perf_counter() - start
        work = Path(tmp) / "work.json"
        work.write_text(json.dumps({"prompts": prompts, "max_tokens": args.max_tokens}))
        offs, ons = [], []
        for _ in range(args.repeats + 1):  # the first pair compiles the kernels: not counted
            offs.append(_in_process_of_its_own(folder, work, engine))
            ons.append(_in_process_of_its_own(folder, work, {**engine, **eplb}))
        warmup = {"off": offs.pop(0)["tokens_per_s"], "on": ons.pop(0)["tokens_per_s"]}
    on = ons[-1]
    report = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": shape,
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        "model_written_s": round(made_s, 1),
        "eplb_off_tokens_per_s": statistics.median(r["tokens_per_s"] for r in offs),
        "eplb_on_tokens_per_s": statistics.median(r["tokens_per_s"] for r in ons),
        "runs_off": [r["tokens_per_s"] for r in offs],
        "runs_on": [r["tokens_per_s"] for r in ons],
        # The decode steps' wall time, p50 / p90 / max ms, of each counted run (every rank ends
        # a step together: the slowest rank's time).
        "decode_step_ms_off": [r["decode_step_ms"] for r in offs],
        "decode_step_ms_on": [r["decode_step_ms"] for r in ons],
        "warmup_runs": warmup,
        "same_tokens_runs": sum(r["outputs"] == offs[0]["outputs"] for r in (*offs, *ons)),
        **on["eplb"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eplb.json").write_text(json.dumps(report, indent=2))
    print("| EPLB | tokens/s (median) | busiest rank's load / mean | decode step p50 ms (runs) |")
    print("| --- | --- | --- | --- |")
    off_ms = [(d or {}).get("p50") for d in report["decode_step_ms_off"]]
    on_ms = [(d or {}).get("p50") for d in report["decode_step_ms_on"]]
    print(
        f"| off | {report['eplb_off_tokens_per_s']} | {report.get('imbalance_before')} | {off_ms} |"
    )
    after = report.get("imbalance_after") or ["-"]
    print(f"| on | {report['eplb_on_tokens_per_s']} | {after[-1]} (after {after}) | {on_ms} |")
    print(json.dumps({k: v for k, v in report.items() if k not in ("shape", "workload")}))


if __name__ == "__main__":
    main()
