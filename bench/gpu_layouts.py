"""Pipeline, tensor and expert parallelism on two or four GPUs as a user runs them (`LLM` on random
bf16 weights of real shapes): time per output token against one GPU, each rank's timeline of
decode steps, and how long `close()` takes.

    python -m pdmesh.bench.gpu_layouts --out DIR [--only dense,moe] [--moe-layers 24]
    python -m pdmesh.bench.gpu_layouts --out DIR --tiny      # a dry run on CPU (gloo)
    python -m pdmesh.bench.gpu_layouts --out DIR --gpus 4 [--layouts tp2pp2]   # dense only
    python -m pdmesh.bench.gpu_layouts --out DIR --gpus 4 --merge DIR1 DIR2 ...

Dense: the Llama-3.1-8B shape at one GPU, TP=2 and PP=2. MoE: the Qwen3-30B-A3B shape cut to
`--moe-layers` of its 48 layers at one GPU, TP=2 and EP=2 (`enable_expert_parallel`). Time per
output token: `batch` sequences decoding together at about `ctx` tokens of context, the
seconds of back-to-back engine steps over the tokens each sequence got (with pipeline stages a
step runs one of the batches in flight, so steps are not tokens). The perfect-scaling ceiling
of two GPUs at batch 64 is two one-GPU engines of 32 sequences each: one GPU's time per token
at batch 32 (the GPUs share nothing). Four GPUs (`--gpus 4`, the dense model): one GPU, TP=4
and TP=2 x PP=2; the ceiling is four one-GPU engines of 16 sequences each, one GPU's time per
token at batch 16. Timelines: 8 decode steps profiled on every rank (torch.profiler;
followers through `ProfileRank`; `--timelines` picks the layouts), summarised by
bench/step_timeline.py. Writes DIR/layouts.json; prints a table. `--merge` joins the
layouts.json of runs made one layout a process (`--layouts`) into DIR/layouts.json, with the
ratios to one GPU and to the ceiling.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import (
    TINY,
    dummy_llm,
    llama_8b_config,
    qwen3_moe_30b_config,
    save_word_tokenizer,
    write_config,
)
from pdmesh.bench.gpu_workloads import _admit, _drain, _sync
from pdmesh.bench.report import Report, free_memory, out_parser, run_info
from pdmesh.bench.step_timeline import follower_lag, summarize
from pdmesh.engine.executor.profiling import ProfileRank, RankProfiler

DENSE = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}
MOE = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    # EPLB (no rebalance within the run) keeps the all_to_all exchange, the only one before
    # 2026-11-27: its host operators are profiled.
    "ep2-eplb": {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "enable_eplb": True,
    },
    # Data-parallel attention, experts over both replicas (one such engine a process on GPUs);
    # `-sync`: each replica reads its tokens before launching its next step (the default until
    # 2026-11-27, when the layout measured as `dp2ep2-async` became `dp2ep2`).
    "dp2ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "dp2ep2-sync": {
        "data_parallel_size": 2,
        "enable_expert_parallel": True,
        "async_scheduling": False,
    },
}
# Host operators recorded too (the profile's own cost slows the host a little); the TP / EP
# layouts also get each follower's lag behind rank 0 (`follower_lag`).
HOST_PROFILED = ("ep2-eplb", "dp2ep2", "dp2ep2-sync", "tp2", "ep2")
# Four GPUs, the dense model. TP=4 and TP=2 x PP=2 register symmetric memory, so on GPUs each
# runs in a process of its own (`--layouts`, then `--merge`).
DENSE4 = {
    "tp1": {},
    "tp4": {"tensor_parallel_size": 4},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


def token_time(engine: Any, batch: int, ctx: int, rounds: int) -> float:
    """Seconds per output token of each of `batch` sequences decoding together at about `ctx`
    tokens of context, over `rounds` tokens a sequence, after 6 warm-up steps."""
    ids = _admit(engine, batch, ctx, max_tokens=rounds + 24)
    for _ in range(6):
        engine.step()
    _sync()
    start, tokens = time.perf_counter(), 0
    while tokens < rounds * batch:
        tokens += sum(len(d.token_ids) for d in engine.step())
    elapsed = time.perf_counter() - start
    _drain(engine, ids)
    while engine.has_unfinished_requests():  # steps still in flight for aborted requests
        engine.step()
    return elapsed * batch / tokens


def _first(engine: Any) -> Any:
    """The engine of rank 0: the engine, or a data-parallel front's own replica."""
    return getattr(engine, "local", engine)


def timeline(
    llm: Any, batch: int, ctx: int, out: Path, name: str, host: bool = False
) -> dict[str, Any]:
    """8 decode steps profiled on every rank: each rank's per-step summary. host: the host's
    operators too."""
    engine, steps = llm.engine, 8
    ids = _admit(engine, batch, ctx, max_tokens=steps + 24)
    for _ in range(6):
        engine.step()
    _sync()
    # Data-parallel replicas after the first are told over their front's sockets.
    replicas = getattr(engine, "replicas", None)
    others = range(len(replicas.procs)) if replicas is not None else range(0)
    driver, here = _first(engine).tp_driver, RankProfiler()
    if driver is not None:
        driver.call(ProfileRank(host=host))
    for i in others:
        replicas.ask(i, {"op": "profile", "trace": "", "host": host})
    here.start(host)
    for _ in range(steps):
        engine.step()
    trace = out / f"trace-{name}"
    here.stop(f"{trace}.rank0.json")
    ranks = engine.config.world_size * (1 + len(others))
    if driver is not None:
        driver.call(ProfileRank(trace=str(trace)))
    for i in others:
        replicas.ask(i, {"op": "profile", "trace": str(trace), "host": host})
    _drain(engine, ids)
    while engine.has_unfinished_requests():
        engine.step()
    result: dict[str, Any] = {}
    traces = []
    for r in range(ranks):
        path = Path(f"{trace}.rank{r}.json")
        if not path.exists():  # a rank of a replica's TP group: not profiled
            continue
        traces.append(json.loads(path.read_text()))
        result[f"rank{r}"] = summarize(traces[-1], steps)
        path.unlink()  # large; the summary is what is kept
    if host and driver is not None and len(traces) > 1:
        result["follower_lag_us"] = follower_lag(traces)
    return result


def run_layouts(
    folder: Path,
    layouts: dict[str, dict[str, Any]],
    cases: list[tuple[int, int]],
    tiny: bool,
    out: Path,
    report: Report,
    key: str,
    gpus: int = 2,
    profiled: set[str] | None = None,
) -> None:
    """Each layout's time per token at `cases` (one GPU also at the ceiling's batch: the last
    case's batch over `gpus`), its timelines (layouts in `profiled`, all if None) and close
    time, recorded under `key`."""
    rounds = 8 if tiny else 32
    ceiling_case = (cases[-1][0] // gpus, cases[-1][1])
    common = dict(
        kv_cache_tokens=8192 if tiny else 80000,
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
    )
    if tiny:
        common["device"] = "cpu"
    results: dict[str, Any] = {}
    for name, options in layouts.items():
        entry: dict[str, Any] = {"options": options}
        start = time.perf_counter()
        llm = dummy_llm(folder, **common, **options)
        entry["start_s"] = time.perf_counter() - start
        entry["graphs"] = _first(llm.engine).runner.graphs is not None
        for batch, ctx in cases + ([ceiling_case] if name == "tp1" else []):
            label = f"b{batch}_ctx{ctx}_ms_per_token"
            entry[label] = token_time(llm.engine, batch, ctx, rounds) * 1e3
            print(f"{key} {name} {label}: {entry[label]:.2f}", flush=True)
        entry["most_in_flight"] = _first(llm.engine).most_in_flight
        # The dry run profiles batch 1 only: a second profile of a CPU pipeline engine crashed
        # in torch 2.13's profiler (see engine/executor/profiling.py).
        for batch, ctx in (
            (cases[:1] if tiny else cases) if profiled is None or name in profiled else []
        ):
            label = f"{key}-{name}-b{batch}"
            entry[f"timeline_b{batch}"] = timeline(
                llm, batch, ctx, out, label, host=name in HOST_PROFILED
            )
        start = time.perf_counter()
        llm.close()
        entry["close_s"] = time.perf_counter() - start
        print(f"{key} {name} close: {entry['close_s']:.2f} s", flush=True)
        del llm
        free_memory()
        results[name] = entry
        report.record(key, results)
    if "tp1" not in results:  # another process measured it (--layouts; then --merge)
        return
    ratios(results, cases, gpus)
    report.record(key, results)


def ratios(results: dict[str, Any], cases: list[tuple[int, int]], gpus: int) -> None:
    """Each layout's time per token over one GPU's (`tp1`), and at the last case's batch over
    the perfect-scaling ceiling: `gpus` one-GPU engines sharing the batch, each sequence then
    getting a token every step of one GPU at batch / gpus (the GPUs share nothing). Until
    2026-11-27 this ceiling was also divided by gpus, as if the times were of all the batch's
    tokens rather than of each sequence's: every "x ceiling" before then is gpus times too
    high (BENCHMARKS.md corrects them)."""
    one = results["tp1"]
    b, ctx = cases[-1]
    ceiling = one[f"b{b // gpus}_ctx{ctx}_ms_per_token"]
    for entry in results.values():
        for batch, c in cases:
            label = f"b{batch}_ctx{c}_ms_per_token"
            entry[f"b{batch}_over_one_gpu"] = entry[label] / one[label]
        entry[f"b{b}_ceiling_ms_per_token"] = ceiling
        entry[f"b{b}_over_ceiling"] = entry[f"b{b}_ctx{ctx}_ms_per_token"] / ceiling


def merge(folders: list[Path], key: str, cases: list[tuple[int, int]], gpus: int) -> dict[str, Any]:
    """The layouts of `key` in each folder's layouts.json (one process a layout), in one dict
    with their ratios; the first folder's device. A layout already merged from an earlier
    folder (the same layout run under another environment, say) is kept as LAYOUT@FOLDER."""
    results: dict[str, Any] = {}
    device: dict[str, Any] = {}
    for folder in folders:
        path = folder / "layouts.json"
        if not path.exists():  # that process died before its first figure
            print(f"{path}: missing", flush=True)
            continue
        data = json.loads(path.read_text())
        device = device or data.get("device", {})
        for name, entry in data.get(key, {}).items():
            if "close_s" in entry:  # a layout measured to its end
                results[name if name not in results else f"{name}@{folder.name}"] = entry
            else:
                print(f"{folder} {name}: unfinished", flush=True)
    if "tp1" in results:
        ratios(results, cases, gpus)
    return {"device": device, key: results}


def table(data: dict[str, Any], cases: dict[str, list[tuple[int, int]]]) -> str:
    lines = [
        "| model | layout | "
        + " | ".join(["ms/token (x one GPU)"] * 2)
        + " | x ceiling | close s |"
    ]
    for key, layout_cases in cases.items():
        for name, e in data.get(key, {}).items():
            cells = [
                f"b{b} ctx{c}: {e[f'b{b}_ctx{c}_ms_per_token']:.2f} ({e[f'b{b}_over_one_gpu']:.2f})"
                for b, c in layout_cases
                if f"b{b}_over_one_gpu" in e
            ]
            if not cells:  # no one-GPU figure in this process
                ms = [(b, c, e[f"b{b}_ctx{c}_ms_per_token"]) for b, c in layout_cases]
                cells = [f"b{b} ctx{c}: {t:.2f}" for b, c, t in ms]
            b = layout_cases[-1][0]
            over = e.get(f"b{b}_over_ceiling")
            ceiling = f"{over:.2f}" if over is not None else "-"
            close = f"{e['close_s']:.2f}" if "close_s" in e else "-"
            lines.append(f"| {key} | {name} | {' | '.join(cells)} | {ceiling} | {close} |")
    return "\n".join(lines)


def main() -> None:
    parser = out_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a dry run)")
    parser.add_argument("--only", default="dense,moe")
    parser.add_argument("--moe-layers", type=int, default=24)
    parser.add_argument(
        "--gpus",
        type=int,
        choices=(2, 4),
        default=2,
        help="4: the dense model at one GPU, TP=4 and TP=2 x PP=2 (ceiling: 4 engines)",
    )
    parser.add_argument(
        "--timelines",
        default=None,
        help="profile only these layouts (default: every layout run)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="join these folders' layouts.json (one layout a process) into OUT/layouts.json",
    )
    parser.add_argument(
        "--layouts",
        default=None,
        help="only these layouts (e.g. ep2): one process each where several would use symmetric "
        "memory (a second such engine in one process hung at start on two H100s, 2026-11-27)",
    )
    args = parser.parse_args()
    if args.merge:
        merged(args)
        return
    report = Report(args.out / "layouts.json")
    report.record("device", {**run_info("name"), "gpus": torch.cuda.device_count()})
    tmp = Path(tempfile.mkdtemp())

    def pick(layouts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        names = args.layouts.split(",") if args.layouts else list(layouts)
        return {n: o for n, o in layouts.items() if n in names}

    cases = layout_cases(args.tiny)
    profiled = set(args.timelines.split(",")) if args.timelines else None
    if args.gpus == 4:
        config = llama_8b_config()
        if args.tiny:
            config.update(TINY)
        folder = write_config(tmp / "dense", config)
        save_word_tokenizer(folder, config.vocab_size)
        dense4 = pick(DENSE4)
        run_layouts(
            folder, dense4, cases["dense"], args.tiny, args.out, report, "dense", 4, profiled
        )
        print(table(report.data, {"dense": cases["dense"]}))
        return
    if "dense" in args.only:
        config = llama_8b_config()
        if args.tiny:
            config.update(TINY)
        folder = write_config(tmp / "dense", config)
        save_word_tokenizer(folder, config.vocab_size)
        run_layouts(
            folder, pick(DENSE), cases["dense"], args.tiny, args.out, report, "dense", 2, profiled
        )
    if "moe" in args.only:
        config = qwen3_moe_30b_config()
        config.num_hidden_layers = args.moe_layers
        if args.tiny:
            config.update(TINY | dict(moe_intermediate_size=32, head_dim=16, num_experts=8))
        folder = write_config(tmp / "moe", config)
        save_word_tokenizer(folder, config.vocab_size)
        run_layouts(
            folder, pick(MOE), cases["moe"], args.tiny, args.out, report, "moe", 2, profiled
        )
    print(json.dumps(report.data, indent=1, default=float)[-6000:])
    print(table(report.data, cases))


def layout_cases(tiny: bool) -> dict[str, list[tuple[int, int]]]:
    """(batch, context) of each model's runs: batch 1 and batch 64 (8 on the dry run)."""
    both = [(1, 64), (8, 64)] if tiny else [(1, 512), (64, 1024)]
    return {"dense": both, "moe": list(both)}


def merged(args: argparse.Namespace) -> None:
    """--merge: the layouts of several processes in one OUT/layouts.json (each model of
    `--only`), and the table."""
    cases = layout_cases(args.tiny)
    keys = [k for k in ("dense", "moe") if k in args.only]
    report = Report(args.out / "layouts.json")
    for key in keys:
        data = merge(args.merge, key, cases[key], args.gpus)
        if not data[key]:
            continue
        report.data.update(data)
        report.save()
        print(table(report.data, {key: cases[key]}))
        for name, entry in data[key].items():
            for b, _ in cases[key]:
                for rank, t in entry.get(f"timeline_b{b}", {}).items():
                    if "window_ms_per_step" not in t:  # no GPU kernels (the CPU dry run)
                        continue
                    cells = ("window", "compute", "nccl", "idle")
                    line = " ".join(f"{c} {t[f'{c}_ms_per_step']:.2f}" for c in cells)
                    # TP's one-shot all-reduces over symmetric memory count as compute: named
                    tops = t.get("top_kernels_ms_per_step", {})
                    reduce = sum(ms for k, ms in tops.items() if "all_reduce" in k)
                    print(
                        f"{name} b{b} {rank}: {line} (all-reduce {reduce:.2f}) "
                        f"kernels {t['kernels_per_step']:.0f}"
                    )


if __name__ == "__main__":
    main()
