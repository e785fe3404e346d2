"""Disaggregated (1 prefill + 1 decode worker) against colocated (2 workers that both prefill and
decode) serving on the same two GPUs, the same engine, the Llama-3.1-8B shape (random weights).

    python -m pdmesh.bench.disagg_gpu --out DIR [--stages ttft,load,tp] [--requests 32] [--trace]
    python -m pdmesh.bench.disagg_gpu --out DIR --stages load --layouts 4gpu   # four GPUs
    python -m pdmesh.bench.disagg_gpu --out DIR --stages load --layouts 4gpu --tiny   # CPU dry run

Layouts on four GPUs (`4gpu` names them all): colocated_4, every static split 1p3d / 2p2d /
3p1d, and planner_4 / planner_4_itl (starting 2p2d, the planner set to the first / second SLO).
On two (`2gpu_planner`): disagg_1p1d, colocated_2 and planner_2 / planner_2_itl (1p1d, whose
planner cannot switch a role's last worker, with load-aware conditional disaggregation).

Each layout is a real `pdmesh up` (a worker a GPU) driven by the serving benchmark's gRPC
client. Stages, each writing DIR/disagg.json as it ends:
- ttft: one 4,096-token prompt at a time; disaggregated TTFT includes the prefill on the other
  GPU and the layer-by-layer KV transfer over `nccl`.
- load: Poisson arrivals at several rates, prefill-heavy (4,096 in / 256 out), chat-like (512
  in / 256 out) and a mix of the two (half each, shuffled): TTFT, TPOT, ITL, throughput, and the
  attainment of two SLOs (TTFT <= 1.5 s with TPOT <= 40 ms; TTFT <= 1 s with each request's p99
  inter-token latency <= 25 ms); goodput is the highest rate before the first attaining < 90%.
  The rates run in turn on one mesh, so a planner's switches at one rate hold into the next;
  each run records the workers' roles at its end and the planner's switches so far.
  Per-request samples go to DIR/disagg_samples.json.
  --trace exports spans (DIR/spans-LAYOUT.txt) and records each span's median [start, end] in
  ms from the router's root span over the TTFT requests.
- tp: decode time per token at batch 1, TP=1 and TP=2 over NCCL (CUDA graphs on both).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdmesh.bench.gpu_models import (
    TINY,
    dummy_llm,
    llama_8b_config,
    save_word_tokenizer,
    write_config,
    write_llama_8b,
)
from pdmesh.bench.latency_stats import RequestRecord, Slo, summarize
from pdmesh.bench.mesh_metrics import Mesh
from pdmesh.bench.report import Report, out_parser
from pdmesh.bench.serving import LoadConfig, Workload, exact_request, make_workload, run_load
from pdmesh.bench.span_timeline import read_spans, span_timeline
from pdmesh.mesh import quiet_up, read_services
from pdmesh.processes import free_port
from pdmesh.supervisor import stop

SLOS = {
    "ttft1.5s_tpot40ms": Slo(ttft_ms=1500, tpot_ms=40),
    "ttft1s_itl99_25ms": Slo(ttft_ms=1000, itl_p99_ms=25),
}
ATTAINMENT = 0.9
# Each workload: its request shapes (input, output), drawn in equal shares.
WORKLOADS = {
    "prefill_heavy": [(4096, 256)],
    "chat": [(512, 256)],
    "mix": [(4096, 256), (512, 256)],
}
RATES = {"prefill_heavy": (1.0, 2.0, 3.0, 4.0), "chat": (2.0, 4.0, 8.0), "mix": (2.0, 4.0, 6.0)}
_SPLIT = ["--disagg-min-tokens", "0"]
_PLANNER = [*_SPLIT, "--planner", "--planner-interval-s", "1", "--planner-sustain", "2"]
LAYOUTS = {
    "disagg_1p1d": ["--prefill", "1", "--decode", "1", *_SPLIT],
    "colocated_2": ["--colocated", "--decode", "2"],
    "colocated_4": ["--colocated", "--decode", "4"],
    **{f"{p}p{4 - p}d": ["--prefill", str(p), "--decode", str(4 - p), *_SPLIT] for p in (1, 2, 3)},
    # The planner starts from the even split; the runs are seconds long, so it may switch
    # every few seconds (its defaults wait 30 s between switches).
    "planner_4": ["--prefill", "2", "--decode", "2", *_PLANNER, "--planner-dwell-s", "5"],
    "planner_4_itl": [
        *["--prefill", "2", "--decode", "2", *_PLANNER, "--planner-dwell-s", "5"],
        *["--slo-ttft-ms", "1000", "--slo-itl-ms", "25", "--slo-itl-p99-ms", "25"],
    ],
    # On two GPUs no switch can keep a worker of each role: what the planner's mesh adds to
    # 1p1d is load-aware conditional disaggregation (a decode worker prefills a prompt itself
    # when the prefill queue would cost the request more).
    "planner_2": ["--prefill", "1", "--decode", "1", *_PLANNER, "--load-aware-disagg"],
    "planner_2_itl": [
        *["--prefill", "1", "--decode", "1", *_PLANNER, "--load-aware-disagg"],
        *["--slo-ttft-ms", "1000", "--slo-itl-ms", "25", "--slo-itl-p99-ms", "25"],
    ],
}
LAYOUT_SETS = {
    "2gpu": ["disagg_1p1d", "colocated_2"],
    "2gpu_planner": ["disagg_1p1d", "colocated_2", "planner_2", "planner_2_itl"],
    "4gpu": ["colocated_4", "1p3d", "2p2d", "3p1d", "planner_4", "planner_4_itl"],
}
ENGINE = ["--load-format", "dummy", "--max-model-len", "8192", "--kv-transport", "nccl"]
TINY_ENGINE: list[str] = []  # --tiny: the dry run's flags, after (overriding) ENGINE's
VOCAB = 128256


@contextlib.contextmanager
def mesh(folder: Path, layout: str, log: Path, spans: Path | None = None) -> Iterator[Mesh]:
    """`pdmesh up` with this layout; yields the router's address once it is up. With `spans`,
    every process prints its spans, and they are written there."""
    port, http_port = free_port(), free_port()
    cmd = quiet_up(
        port, "--model", str(folder), *ENGINE, *LAYOUTS[layout], *TINY_ENGINE, http_port=http_port
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDMESH_LOG_LEVEL": "WARNING"}
    if spans is not None:
        env |= {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY_MILLIS": "200"}
    with log.open("w") as sink, (spans or Path(os.devnull)).open("w") as span_sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sink, text=True, env=env)
        assert proc.stdout is not None
        try:
            start = time.monotonic()
            try:  # the workers print their spans to this pipe too
                services = read_services(proc.stdout, span_sink.write)
            except RuntimeError:
                raise RuntimeError(f"{layout}: the mesh did not come up; see {log}") from None
            took = time.monotonic() - start
            print(f"{layout}: up in {took:.0f} s ({time.strftime('%T')})", flush=True)
            metrics = {s.name: s.metrics for s in services if s.metrics}
            metrics["router"] = f"http://127.0.0.1:{http_port}/metrics"
            yield Mesh(f"127.0.0.1:{port}", metrics)
        finally:
            stop(proc, 60)


def load(
    target: str, n: int, in_len: int, out_len: int, rate: float, seed: int, conc: int | None = None
) -> tuple[list[RequestRecord], float]:
    cfg = LoadConfig(n, in_len, out_len, rate, concurrency=conc, seed=seed)
    return asyncio.run(run_load(target, make_workload(cfg, VOCAB), cfg, progress=False))


def mixed_load(
    target: str, n: int, shapes: list[tuple[int, int]], rate: float, seed: int
) -> tuple[list[RequestRecord], float]:
    """`n` requests of the `shapes` in equal shares, shuffled, on one Poisson schedule."""
    parts = [
        make_workload(LoadConfig(n // len(shapes), i, o, rate, seed=seed + k), VOCAB)
        for k, (i, o) in enumerate(shapes)
    ]
    pairs = [x for w in parts for x in zip(w.prompts, w.output_lens, strict=True)]
    random.Random(seed).shuffle(pairs)
    work = Workload([p for p, _ in pairs], [o for _, o in pairs], parts[0].warmup_prompt)
    cfg = LoadConfig(len(pairs), shapes[0][0], shapes[0][1], rate, seed=seed)
    return asyncio.run(run_load(target, work, cfg, progress=False))


def warm(target: str, in_len: int, seed: int) -> None:
    """Full-size requests first: a fresh process compiles kernels for shapes it has not seen."""
    load(target, 4, in_len, 8, math.inf, seed)


async def _server_timings(target: str, n: int, seed: int) -> list[dict[str, float]]:
    """The mesh's own timings (last response of each stream) of `n` 4,096-token prompts in turn."""
    import grpc

    from pdmesh.v1 import generation_pb2_grpc

    rng = random.Random(seed)
    out = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for _ in range(n):
            req = exact_request([rng.randrange(1000, VOCAB) for _ in range(4096)], 2)
            last = [r async for r in stub.Generate(req, timeout=60)][-1].timings
            ms = {
                f"{k}_ms": getattr(last, f"{k}_ns") / 1e6
                for k in ("queue", "prefill", "first_token")
            }
            out.append({**ms, "disaggregated": last.disaggregated})
    return out


# Histograms read around the TTFT runs: where a remote prefill's time goes.
BREAKDOWN = {
    "prefill_worker_ms": ("prefill-0", "pdmesh_prefill_time_seconds"),  # received -> 1st token
    "prefill_queue_ms": ("prefill-0", "pdmesh_prefill_queue_time_seconds"),  # -> 1st forward
    "kv_send_ms": ("prefill-0", "pdmesh_kv_transfer_duration_seconds"),  # first frame -> last
    "kv_receive_ms": ("decode-0", "pdmesh_kv_transfer_duration_seconds"),
}


def ttft_stage(mesh: Mesh, layout: str, res: Report, spans: Path | None = None) -> None:
    target = mesh.target
    warm(target, 4096, 900)
    parts = {k: v for k, v in BREAKDOWN.items() if v[0] in mesh.metrics}
    before = {k: mesh.scrape(*v) for k, v in parts.items()}
    records, duration = load(target, 8, 4096, 2, math.inf, 901, conc=1)
    after = {k: mesh.scrape(*v) for k, v in parts.items()}
    s = summarize(records, duration, Slo())
    since_ms = time.time() * 1e3
    server = asyncio.run(_server_timings(target, 4, 902))
    means = {}
    for key in parts:
        n = after[key][1] - before[key][1]
        means[key] = round((after[key][0] - before[key][0]) / n * 1e3, 3) if n else None
    res.record(
        f"ttft_4096_{layout}",
        {
            "ttft_ms": s["ttft_ms"],
            "completed": s["completed"],
            "server_timings": server,
            "worker_means": means,
        },
    )
    if spans is not None:
        time.sleep(3.0)  # the last spans are exported in batches
        res.record(f"ttft_spans_{layout}", span_timeline(read_spans(spans), since_ms))


def goodput_rate(runs: list[dict[str, Any]], slo: str) -> float:
    """The highest rate of `runs` (in rising order) before the first whose attainment of `slo`
    is below ATTAINMENT (0: the first)."""
    held = itertools.takewhile(lambda r: r["attainment"][slo] >= ATTAINMENT, runs)
    return max((r["request_rate"] for r in held), default=0.0)


def load_stage(up: Mesh, layout: str, n: int, res: Report, samples: Report) -> None:
    for wi, (work, shapes) in enumerate(WORKLOADS.items()):
        warm(up.target, max(i for i, _ in shapes), 100 + wi)
        runs = []
        for ri, rate in enumerate(RATES[work]):
            before = up.dispatches()
            records, duration = mixed_load(up.target, n, shapes, rate, 1000 + 97 * wi + ri)
            s = summarize(records, duration, Slo())
            s["request_rate"] = rate
            s["attainment"] = {
                name: round(sum(slo.met(r) for r in records) / len(records), 3)
                for name, slo in SLOS.items()
            }
            s["roles_after"] = up.roles()
            s["planner_switches_so_far"] = up.switches()
            # Prompts the decode workers prefilled themselves (load-aware disaggregation).
            s["dispatched"] = {k: v - before.get(k, 0) for k, v in up.dispatches().items()}
            runs.append(s)
            samples.data[f"{layout}/{work}/{rate:g}"] = {
                "ttft_ms": [round(r.ttft_s * 1e3, 3) for r in records if r.ok],
                "itl_ms": [round(x * 1e3, 3) for r in records if r.ok for x in r.itls_s],
            }
            samples.save()
            print(
                f"  {layout} {work} rate {rate:g}: ttft p50 {s['ttft_ms']['p50']:.0f} ms, "
                f"tpot p50 {s['tpot_ms']['p50']:.1f} ms, itl p99 {s['itl_ms']['p99']:.1f} ms, "
                f"attainment {' / '.join(f'{a:.2f}' for a in s['attainment'].values())}, "
                f"local prefills {s['dispatched'].get('local_prefill', 0):.0f}, "
                f"roles {s['roles_after']}, switches {s['planner_switches_so_far']} "
                f"({time.strftime('%T')})",
                flush=True,
            )
        goodput = {name: goodput_rate(runs, name) for name in SLOS}
        res.record(f"load_{work}_{layout}", {"runs": runs, "goodput_rate_at_90pct": goodput})


def tp_stage(
    folder: Path, res: Report, profile: bool = False, all_reduce: tuple[str, ...] = ("auto",)
) -> None:
    """Batch-1 decode time per token, TP=1 against TP=2 over NCCL (dummy weights, bf16), TP=2
    once per PDMESH_ALL_REDUCE way in `all_reduce` (the first is also profiled)."""
    from pdmesh.bench.gpu_workloads import decode_step_time, profile_decode

    out: dict[str, float | bool | str] = {}
    runs = [(1, "")] + [(2, way) for way in all_reduce]
    for tp, way in runs:
        key = f"tp{tp}" + (f"_{way}" if tp > 1 and len(all_reduce) > 1 else "")
        os.environ["PDMESH_ALL_REDUCE"] = way or "auto"  # followers inherit it
        with dummy_llm(
            folder, tensor_parallel_size=tp, kv_cache_tokens=32768, max_model_len=4096
        ) as llm:
            out[f"{key}_step_ms_b1"] = decode_step_time(llm.engine, 1, 256) * 1e3
            out[f"{key}_graphs"] = llm.engine.runner.graphs is not None
            fast = llm.engine.runner.tp.fast.get("all_reduce")
            if fast is not None:
                out[f"{key}_all_reduce"] = "copy in kernel" if fast.copy_in_kernel else "staged"
            if profile and way in ("", all_reduce[0]):
                text = profile_decode(llm.engine, 1, 256)
                (res.path.parent / f"tp{tp}_decode_profile.txt").write_text(text)
        gc.collect()
        if tp > 1:
            out[f"{key}_over_tp1"] = out[f"{key}_step_ms_b1"] / out["tp1_step_ms_b1"]
        print(f"  {key}: {out[f'{key}_step_ms_b1']:.3f} ms per step", flush=True)
    os.environ.pop("PDMESH_ALL_REDUCE", None)
    res.record("tp2_vs_tp1_decode_b1", out)


def _tiny_dry_run(folder: Path) -> Path:
    """A tiny model on the CPU (KV over tcp), workloads a 32nd as long: the script's dry run."""
    config = llama_8b_config()
    config.update(TINY)
    write_config(folder, config)
    save_word_tokenizer(folder, config.vocab_size)
    TINY_ENGINE[:] = ["--device", "cpu", "--kv-transport", "tcp", "--max-model-len", "1024"]
    for work, shapes in WORKLOADS.items():
        WORKLOADS[work] = [(i // 32, o // 32) for i, o in shapes]
    global VOCAB
    VOCAB = config.vocab_size
    return folder


def main() -> None:
    parser = out_parser(__doc__)
    parser.add_argument("--stages", default="ttft,load,tp")
    parser.add_argument("--layouts", default="2gpu", help="names, or a set: 2gpu | 4gpu")
    parser.add_argument("--requests", type=int, default=32, help="requests per load run")
    parser.add_argument("--profile", action="store_true", help="tp: profile decode (OUT/tp*.txt)")
    parser.add_argument("--all-reduce", default="auto", help="tp: PDMESH_ALL_REDUCE ways to time")
    parser.add_argument("--trace", action="store_true", help="ttft: a span timeline of a request")
    parser.add_argument("--tiny", action="store_true", help="a dry run on the CPU, tiny shapes")
    parser.add_argument("--rates", help='req/s per workload, e.g. "prefill_heavy=6,8;chat=16"')
    args = parser.parse_args()
    if args.rates:
        chosen = dict(item.split("=") for item in args.rates.split(";"))
        for work in list(WORKLOADS):
            if work in chosen:
                RATES[work] = tuple(float(r) for r in chosen[work].split(","))
            else:
                del WORKLOADS[work]
    stages = set(args.stages.split(","))
    if args.tiny:
        folder = _tiny_dry_run(Path(tempfile.mkdtemp()) / "tiny")
    else:
        folder = write_llama_8b(Path(tempfile.mkdtemp()) / "llama-8b-shape")
    res = Report(args.out / "disagg.json", date=time.strftime("%Y-%m-%d %H:%M"))
    samples = Report(args.out / "disagg_samples.json", indent=None)
    layouts = [x for name in args.layouts.split(",") for x in LAYOUT_SETS.get(name, [name])]
    for layout in layouts:
        if not stages & {"ttft", "load"}:
            break
        spans = args.out / f"spans-{layout}.txt" if args.trace else None
        with mesh(folder, layout, args.out / f"mesh-{layout}.log", spans) as up:
            if "ttft" in stages:
                ttft_stage(up, layout, res, spans)
            if "load" in stages:
                load_stage(up, layout, args.requests, res, samples)
    if "tp" in stages:
        tp_stage(folder, res, args.profile, tuple(args.all_reduce.split(",")))


if __name__ == "__main__":
    main()
