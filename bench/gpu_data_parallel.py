"""Data parallelism on GPUs through `LLM.generate`, as a user runs it: offline throughput
(`--requests` prompts of `--prompt-len` random tokens, `--output-len` tokens each, ignore-EOS)
and decode time per output token at batch 1 (512-token prompts) and batch 64 (1,024-token
prompts), for one GPU and each two-GPU layout, against the perfect-scaling ceiling: two one-GPU
engines run side by side (two processes, a GPU each), each on half the requests.

    python -m pdmesh.bench.gpu_data_parallel --out DIR [--model moe,dense] [--layouts ...]
    python -m pdmesh.bench.gpu_data_parallel --out DIR --gpus 4   # MoE: DP=4 + EP=4, DP=2 + EP=2;
                                                                  # dense: TP=4, TP=2 x PP=2
    python -m pdmesh.bench.gpu_data_parallel --out DIR --tiny     # a dry run on CPU (gloo)
    python -m pdmesh.bench.gpu_data_parallel --out DIR --profile  # + where the steps' time goes
    python -m pdmesh.bench.gpu_data_parallel --out DIR --watch    # every step timed, by phase

MoE: the Qwen3-30B-A3B shape cut to `--moe-layers` of its 48 layers; layouts one GPU, DP=2 + EP=2
(data-parallel attention, experts split over both), EP=2 (tensor-parallel attention), DP=2
without EP (two replicas holding every expert). Dense: the Llama-3.1-8B shape; one GPU, DP=2,
TP=2, PP=2. Time per token at batch b: (wall of `b` requests with 160 output tokens - wall of
`b` others with 32) / 128, so prefill cancels out; the batch-64 ceiling is one GPU's time at
batch 32 (two engines of 32 share nothing). Every layout runs in a process of its own, under a
timeout. Writes DIR/data_parallel.json; prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.gpu_models import (
    TINY,
    dummy_llm,
    llama_8b_config,
    qwen3_moe_30b_config,
    save_word_tokenizer,
    write_config,
)
from pdmesh.bench.report import Report, out_parser, run_info
from pdmesh.bench.step_watch import StepWatch

LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "moe": {
        "tp1": {},
        "dp2ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
        "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
        "dp2": {"data_parallel_size": 2},
    },
    "dense": {
        "tp1": {},
        "dp2": {"data_parallel_size": 2},
        "tp2": {"tensor_parallel_size": 2},
        "pp2": {"pipeline_parallel_size": 2},
    },
}
# Four GPUs (`--gpus 4`): the MoE model against one GPU, DP=2 + EP=2 and four one-GPU engines;
# the dense one (issue 31) at TP=4 and TP=2 x PP=2.
LAYOUTS4: dict[str, dict[str, dict[str, Any]]] = {
    "moe": {
        "tp1": {},
        "dp4ep4": {"data_parallel_size": 4, "enable_expert_parallel": True},
        "dp2ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    },
    "dense": {
        "tp1": {},
        "tp4": {"tensor_parallel_size": 4},
        "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    },
}
LAYOUT_TIMEOUT_S = 300


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(n)]


def _generate_s(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> float:
    from pdmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return wall


def token_time(llm: Any, batch: int, prompt_len: int, vocab: int, long: int, short: int) -> float:
    """Seconds per output token at `batch`: prefill cancels out between two runs of different
    prompts (no prefix hits) that differ only in their output length, after an untimed run of
    the same shape (on two H100s the first run of a new batch shape took longer than the one
    after it, making DP=2 + EP=2's batch-64 figure negative)."""
    _generate_s(llm, _prompts(batch, prompt_len, vocab, 3 + batch), short)
    t_short = _generate_s(llm, _prompts(batch, prompt_len, vocab, 11 + batch), short)
    t_long = _generate_s(llm, _prompts(batch, prompt_len, vocab, 23 + batch), long)
    return (t_long - t_short) / (long - short)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One layout in this process: build, throughput, token times, close."""
    options = json.loads(args.options)
    vocab = json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    llm = dummy_llm(Path(args.folder), device=args.device, **options)
    out: dict[str, Any] = {"options": options, "build_s": time.perf_counter() - start}
    index, parts = (int(x) for x in args.share.split("/"))
    requests = _prompts(args.requests, args.prompt_len, vocab, 5)[index::parts]
    _generate_s(llm, _prompts(8, args.prompt_len, vocab, 99), 8)  # warm-up
    if args.gc_freeze:  # what is alive now (the engine, the model) is left out of collections
        gc.collect()
        gc.freeze()
    watch = None
    if args.profile or args.watch:  # --watch: every step timed, none profiled
        first = (3 if args.tiny else args.profile_first) if args.profile else 1 << 30
        watch = StepWatch(llm.engine, Path(args.json).with_suffix(""), first, args.keep_traces)
    wall = _generate_s(llm, requests, args.output_len)
    if watch is not None:
        out["steps"] = watch.finish()
    out.update(requests=len(requests), throughput_wall_s=wall)
    out["most_in_flight"] = getattr(llm.engine, "most_in_flight", None)  # batches on the device
    out["output_tok_s"] = len(requests) * args.output_len / wall
    if not args.throughput_only:
        long, short = (24, 8) if args.tiny else (160, 32)
        for batch, prompt_len in args.cases:
            key = f"tpot_b{batch}_ms"
            out[key] = 1e3 * token_time(llm, batch, prompt_len, vocab, long, short)
    start = time.perf_counter()
    llm.close()
    out["close_s"] = time.perf_counter() - start
    return out


def _launch(args: argparse.Namespace, folder: Path, options: dict[str, Any], device: str,
            share: str, path: Path, throughput_only: bool) -> subprocess.Popen[bytes]:  # fmt: skip
    argv = [sys.executable, "-m", "pdmesh.bench.gpu_data_parallel", "--one", "--folder",
            str(folder), "--options", json.dumps(options), "--device", device, "--share", share,
            "--json", str(path), "--requests", str(args.requests), "--prompt-len",
            str(args.prompt_len), "--output-len", str(args.output_len), "--cases",
            json.dumps(args.cases)]  # fmt: skip
    if args.profile and not throughput_only:
        argv.append("--profile")
    if throughput_only:
        argv.append("--throughput-only")
    if args.watch:
        argv.append("--watch")
    argv += ["--profile-first", str(args.profile_first)]
    if args.gc_freeze:
        argv.append("--gc-freeze")
    if args.keep_traces:
        argv.append("--keep-traces")
    if args.tiny:
        argv.append("--tiny")
    return subprocess.Popen(argv)


def _wait(procs: list[subprocess.Popen[bytes]], paths: list[Path]) -> list[dict[str, Any]]:
    results = []
    for proc, path in zip(procs, paths, strict=True):
        try:
            proc.wait(LAYOUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            results.append({"error": f"timed out after {LAYOUT_TIMEOUT_S} s"})
            continue
        if not path.exists():
            results.append({"error": f"exit code {proc.returncode}"})
            continue
        result = json.loads(path.read_text())
        if proc.returncode != 0:  # measured, then failed on its way out: say so
            result["exit_code"] = proc.returncode
        results.append(result)
    return results


def run_model(args: argparse.Namespace, name: str, folder: Path, report: Report) -> None:
    device = "cpu" if args.tiny else "cuda:0"
    tmp = args.out if args.keep_traces else Path(tempfile.mkdtemp())
    layouts = (LAYOUTS4 if args.gpus == 4 else LAYOUTS)[name]
    picked = args.layouts.split(",") if args.layouts else list(layouts)
    results: dict[str, Any] = {}
    for layout in picked:
        path = tmp / f"{name}-{layout}.json"
        proc = _launch(args, folder, layouts[layout], device, "0/1", path, False)
        results[layout] = _wait([proc], [path])[0]
        report.record(name, results)
    if args.skip_ceiling:
        return
    # The ceiling: N one-GPU engines side by side, each on 1/N of the requests.
    n = args.gpus
    devices = ["cpu"] * n if args.tiny else [f"cuda:{i}" for i in range(n)]
    paths = [tmp / f"{name}-ceiling-{i}.json" for i in range(n)]
    procs = [_launch(args, folder, {}, d, f"{i}/{n}", p, True) for i, (d, p) in
             enumerate(zip(devices, paths, strict=True))]  # fmt: skip
    halves = _wait(procs, paths)
    if all("error" not in h for h in halves):
        wall = max(h["throughput_wall_s"] for h in halves)
        tok = sum(h["requests"] for h in halves) * args.output_len / wall
        results["ceiling"] = {"output_tok_s": tok, "halves": halves}
    else:
        results["ceiling"] = {"error": [h.get("error") for h in halves]}
    ratios(results, args.cases, args.gpus)
    report.record(name, results)


def ratios(results: dict[str, Any], cases: list[list[int]], gpus: int) -> None:
    one, ceiling = results.get("tp1", {}), results.get("ceiling", {})
    for layout, r in results.items():
        if "error" in r or layout == "ceiling":
            continue
        if "output_tok_s" in one:
            r["throughput_vs_one_gpu"] = r["output_tok_s"] / one["output_tok_s"]
        if "output_tok_s" in ceiling:
            r["throughput_vs_ceiling"] = r["output_tok_s"] / ceiling["output_tok_s"]
        for batch, _ in cases:
            key = f"tpot_b{batch}_ms"
            if key in r and key in one:
                r[f"tpot_b{batch}_vs_one_gpu"] = r[key] / one[key]
        if "tpot_b64_ms" in r and f"tpot_b{64 // gpus}_ms" in one:
            r["tpot_b64_vs_ceiling"] = r["tpot_b64_ms"] / one[f"tpot_b{64 // gpus}_ms"]


def phases(data: dict[str, Any]) -> str:
    """Where each engine's throughput run went (--watch, --profile): seconds of prefill steps
    (those with prompt tokens) and of decode-only steps, and the decode step's median."""
    rows = ["| model | engine | wall s | prefill s (steps) | decode s (steps) | decode p50 ms |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name in LAYOUTS:
        for layout, r in data.get(name, {}).items():
            runs = r.get("halves", []) if layout == "ceiling" else [r]
            for i, run in enumerate(runs):
                steps = run.get("steps")
                if not steps:
                    continue
                pre, dec = steps["prefill"], steps["decode_only"]
                engine = f"{layout} {i}" if layout == "ceiling" else layout
                p50 = steps.get("decode_step_ms", {}).get("p50", "-")
                rows.append(
                    f"| {name} | {engine} | {run['throughput_wall_s']:.2f} | "
                    f"{pre['seconds']:.2f} ({pre['steps']}) | "
                    f"{dec['seconds']:.2f} ({dec['steps']}) | {p50} |"
                )
    return "\n".join(rows) if len(rows) > 2 else ""


def table(data: dict[str, Any]) -> str:
    rows = ["| model | layout | tok/s | vs 1 GPU | vs ceiling | b1 ms | b64 ms (vs 1) | close s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name in LAYOUTS:
        for layout, r in data.get(name, {}).items():
            if "error" in r:
                rows.append(f"| {name} | {layout} | {r['error']} |")
                continue

            def f(key: str, fmt: str = ".2f", r: dict[str, Any] = r) -> str:
                return format(r[key], fmt) if key in r else "-"

            rows.append(
                f"| {name} | {layout} | {f('output_tok_s', '.0f')} | "
                f"{f('throughput_vs_one_gpu')} | {f('throughput_vs_ceiling')} | "
                f"{f('tpot_b1_ms')} | {f('tpot_b64_ms')} ({f('tpot_b64_vs_one_gpu')}) | "
                f"{f('close_s')} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = out_parser(__doc__, out_required=False)
    parser.add_argument("--model", default="moe,dense")
    parser.add_argument("--gpus", type=int, default=2, choices=(2, 4))
    parser.add_argument("--layouts", help="only these layouts (the ceiling always runs)")
    parser.add_argument("--moe-layers", type=int, default=24)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cases", default="[[1, 512], [32, 1024], [64, 1024]]")
    parser.add_argument("--tiny", action="store_true", help="a dry run on CPU, tiny shapes")
    parser.add_argument("--skip-ceiling", action="store_true", help="no two one-GPU engines")
    parser.add_argument("--keep-traces", action="store_true", help="with --profile: keep them")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after the warm-up in each engine's process (rank 0's)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="the throughput run's steps (wall, tokens by kind) and a profile of 8 on every rank",
    )
    parser.add_argument("--profile-first", type=int, default=40, help="the first step profiled")
    parser.add_argument(
        "--watch",
        action="store_true",
        help="every engine's throughput-run steps (wall, tokens by kind, rows), none profiled",
    )
    # One layout in this process (the parent's child).
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--share", default="0/1", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--throughput-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cases = json.loads(args.cases)
    if args.one:
        args.json.write_text(json.dumps(run_one(args)))
        return
    if args.out is None:
        parser.error("--out is required")
    if args.gpus == 4 and args.cases == json.loads(parser.get_default("cases")):
        args.cases.insert(1, [16, 1024])  # four engines of 16: the batch-64 ceiling
    if args.tiny:
        args.requests, args.prompt_len, args.output_len = 16, 32, 8
        args.cases = [[b, 16] for b, _ in args.cases]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    report = Report(args.out / "data_parallel.json", **run_info(), requests=args.requests,
                    prompt_len=args.prompt_len, output_len=args.output_len)  # fmt: skip
    root = Path(tempfile.mkdtemp())
    for name in args.model.split(","):
        if args.tiny:
            shape = {**TINY, "intermediate_size": 128}
            extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
            import transformers

            cls = "Qwen3MoeConfig" if name == "moe" else "LlamaConfig"
            config = getattr(transformers, cls)(
                **shape, **(extra if name == "moe" else {}), tie_word_embeddings=False,
                architectures=[cls.replace("Config", "ForCausalLM")],
            )  # fmt: skip
        elif name == "moe":
            config = qwen3_moe_30b_config()
            config.num_hidden_layers = args.moe_layers
        else:
            config = llama_8b_config()
        folder = write_config(root / name, config)
        save_word_tokenizer(folder, config.vocab_size)
        run_model(args, name, folder, report)
    print(table(report.data))
    print(phases(report.data))


if __name__ == "__main__":
    main()
