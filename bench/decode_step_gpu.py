"""A batch-1 decode step on one GPU: wall time, the graph replay alone, and the host around it,
with the narrow decode projections on the matmul library and on the GEMV kernel, and with
async scheduling (each step launched before the previous one's tokens are read).

    python -m pdmesh.bench.decode_step_gpu --out DIR [--profile] [--quantization fp8]
        [--variants cublas,gemv,gemv-async,gemv-async-nopdl] [--batch 1 --context 512]

Two bf16 random-weight models: the Llama-3.1-8B shape and one TP=2 rank's shard of it (half
the heads, MLP and vocabulary: what a rank computes per step, collectives aside), each built
with PDMESH_GEMV_MAX_ROWS=0 (cuBLAS), =1 (the GEMV, default), and the GEMV with async
scheduling. Each build's batch-1 logits on one fixed token are compared with cuBLAS's (relative
error in the results). With --quantization fp8 the weights are quantized at load: "cublas" is
then the per-token quantization and cuBLASLt's fp8 GEMM (torch._scaled_mm), "gemv" the fp8 GEMV
(weight-only), and the floors count the fp8 bytes. "gemv-async-nopdl" is "gemv-async" with
PDMESH_PDL=0 (no programmatic dependent launch); "gemv4": up to 4 rows on the GEMV
(PDMESH_GEMV_MAX_ROWS=4). --batch / --context: a larger step (the floor then counts the
batch's KV too). Writes DIR/decode_step[-fp8]-bB.json (--profile: a
torch.profiler table per setting); prints a table.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import dummy_llm, llama_8b_config, write_config
from pdmesh.bench.gpu_workloads import decode_step_time, profile_decode, weight_bytes
from pdmesh.bench.report import Report, ceilings, free_memory, median_s, out_parser, run_info


def tp2_shard_config() -> Any:
    config = llama_8b_config()
    config.num_attention_heads //= 2
    config.num_key_value_heads //= 2
    config.intermediate_size //= 2
    config.vocab_size //= 2
    config.head_dim = 128  # kept: the halved head count would otherwise halve it
    return config


# (name, PDMESH_GEMV_MAX_ROWS, async scheduling, PDMESH_PDL)
VARIANTS = [
    ("cublas", 0, False, "1"),
    ("gemv", 1, False, "1"),
    ("gemv-async", 1, True, "1"),
    ("gemv-async-nopdl", 1, True, "0"),
    ("gemv4-async", 4, True, "1"),
]


def fixed_token_logits(engine: Any) -> torch.Tensor:
    """The batch-1 graph's logits for token 1000 at position 0 of an empty cache (block 0)."""
    g = engine.runner.graphs
    g.input_ids[0], g.positions[0], g.slot_mapping[0] = 1000, 0, 0
    g.block_tables[0].zero_()
    g.context_lens[0] = 1
    g.graphs[1].replay()
    return g.outputs[1][0].float().clone()


def measure(
    folder: Path,
    variant: tuple[str, int, bool, str],
    profile: bool,
    out: Path,
    bw: float,
    quantization: str | None = None,
    batch: int = 1,
    context: int = 512,
    kv_cache_dtype: str = "auto",
) -> tuple[dict[str, Any], torch.Tensor]:
    name, gemv_rows, overlap, use_pdl = variant
    os.environ["PDMESH_GEMV_MAX_ROWS"] = str(gemv_rows)
    os.environ["PDMESH_PDL"] = use_pdl
    llm = dummy_llm(
        folder,
        kv_cache_tokens=max(32768, batch * (context + 64)),
        max_num_seqs=64,
        max_model_len=8192,
        async_scheduling=overlap,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.engine
    wbytes = weight_bytes(engine.runner)
    kv_bytes = batch * (context + 16) * engine.runner.kv_spec.bytes_per_token
    step_ms = decode_step_time(engine, batch, context, steps=40) * 1e3
    graph = engine.runner.graphs.graphs.get(batch)  # a graph bucket's size, or none
    replay_ms = median_s(graph.replay, warmup=20) * 1e3 if graph else float("nan")
    logits = fixed_token_logits(engine)
    result = {
        "model": folder.name,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "variant": name,
        "batch": batch,
        "context": context,
        "weight_gb": wbytes / 1e9,
        "kv_gb": kv_bytes / 1e9,
        "floor_ms": (wbytes + kv_bytes) / bw * 1e3,
        "step_ms": step_ms,
        "replay_ms": replay_ms,
        "host_ms": step_ms - replay_ms,
    }
    if profile and folder.name == "llama8b":
        table = profile_decode(engine, batch, context)
        kind = (f"-{quantization}" if quantization else "") + (
            f"-kv{kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
        )
        (out / f"profile-{folder.name}-{name}{kind}-b{batch}.txt").write_text(table)
    del llm, engine
    free_memory()
    return result, logits


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quantization", default=None, help="fp8: the weights in FP8")
    parser.add_argument(
        "--variants", default=",".join(v[0] for v in VARIANTS), help="which builds, by name"
    )
    parser.add_argument("--models", default="llama8b,llama8b-tp2-shard")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding a step")
    parser.add_argument("--context", type=int, default=512, help="tokens each has")
    parser.add_argument("--kv-cache-dtype", default="auto", help="fp8: an fp8 KV cache")
    args = parser.parse_args(argv)
    bw = ceilings()["copy_gb_s"] * 1e9
    kind = (f"-{args.quantization}" if args.quantization else "") + (
        f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    )
    report = Report(
        args.out / f"decode_step{kind}-b{args.batch}.json",
        indent=1,
        **run_info(),
        copy_gb_s=bw / 1e9,
    )
    tmp = Path(tempfile.mkdtemp())
    configs = {"llama8b": llama_8b_config, "llama8b-tp2-shard": tp2_shard_config}
    models = [write_config(tmp / m, configs[m]()) for m in args.models.split(",")]
    chosen = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    for folder in models:
        reference = None
        for variant in chosen:
            r, logits = measure(
                folder,
                variant,
                args.profile,
                args.out,
                bw,
                args.quantization,
                args.batch,
                args.context,
                args.kv_cache_dtype,
            )
            reference = logits if reference is None else reference
            r["logits_rel_err"] = float((logits - reference).norm() / reference.norm())
            report.append("results", r)
            print(
                f"{r['model']:18s} {variant[0]:9s} step {r['step_ms']:.3f} ms, replay "
                f"{r['replay_ms']:.3f} ms (floor {r['floor_ms']:.3f}), host {r['host_ms']:.3f} "
                f"ms, logits vs cuBLAS {r['logits_rel_err']:.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
