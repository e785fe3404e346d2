"""The engine on one GPU against the hardware ceilings and transformers, in one run.

    python -m pdmesh.bench.gpu --out DIR [--only decode,peer,moe,longctx] [--quantization fp8]

Random-initialised bf16 weights of real model shapes (load_format="dummy"); --quantization fp8
quantizes them at load (floors then count the fp8 bytes; the prefill is compared with the fp8
matmul rate). Ceilings are measured in the same run: device-to-device copy bandwidth (bytes
read + written), a large bf16 matmul and, on Hopper, a large fp8 one (rowwise scales). Every
figure is written to DIR/gpu.json as soon as it is measured; a table is printed last. See
BENCHMARKS.md for what each target means.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import dummy_llm, llama_8b_config, qwen3_moe_30b_config, write_config
from pdmesh.bench.gpu_workloads import (
    decode_step_time,
    moe_touched_experts,
    prefill_time,
    profile_decode,
    timed_generate,
    weight_bytes,
)
from pdmesh.bench.report import Report, ceilings, free_memory, median_s, out_parser, run_info


def offline_prompts() -> list[list[int]]:
    """The offline workload's 256 prompts of 512 tokens (fixed seed)."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(256)]


def matmul_rate(ceil: dict[str, float]) -> float:
    """TFLOP/s the projections can reach: the fp8 matmul's under FP8, else bf16's."""
    fp8 = DENSE.get("quantization") == "fp8"
    return ceil["fp8_matmul_tflop_s"] if fp8 else ceil["matmul_tflop_s"]


def dense_section(folder: Path, ceil: dict[str, float], report: Report) -> None:
    llm = dummy_llm(folder, **DENSE, kv_cache_tokens=300_000)
    wbytes = weight_bytes(llm.engine.runner)
    bw = ceil["copy_gb_s"] * 1e9
    kv_per_token = llm.engine.runner.kv_spec.bytes_per_token

    def decode(batch: int, ctx: int) -> dict[str, float]:
        step = decode_step_time(llm.engine, batch, ctx)
        floor = (wbytes + batch * (ctx + 16) * kv_per_token) / bw
        return {
            "batch": batch,
            "context": ctx,
            "step_ms": step * 1e3,
            "floor_ms": floor * 1e3,
            "ratio_to_floor": step / floor,
        }

    def replay_only() -> dict[str, float]:
        """The batch-1 graph alone (no scheduling, no input copies, no sampling): how much of
        a step is GPU time and how much the host around it."""
        ms = median_s(llm.engine.runner.graphs.graphs[1].replay, warmup=20) * 1e3
        floor_ms = wbytes / bw * 1e3
        return {"graph_replay_ms": ms, "floor_ms": floor_ms, "ratio": ms / floor_ms}

    def prefill() -> dict[str, float]:
        seconds, flops = prefill_time(llm.engine, 4096)
        rate = flops / seconds / 1e12
        return {
            "tokens": 4096,
            "ms": seconds * 1e3,
            "tflop": flops / 1e12,
            "tflop_s": rate,
            "fraction_of_matmul": rate / matmul_rate(ceil),
        }

    report.guarded("decode_b1", lambda: decode(1, 512))
    report.guarded("decode_b1_graph_only", replay_only)
    report.guarded("decode_b64_ctx1024", lambda: decode(64, 1024))
    report.guarded("prefill_4096", prefill)
    sweep = (1, 4, 16, 32, 64, 128, 256)
    report.guarded("decode_sweep_ctx1024", lambda: [decode(b, 1024) for b in sweep])
    report.guarded("offline_engine", lambda: offline(llm, ceil, wbytes, kv_per_token))


def long_context_section(
    folder: Path, ceil: dict[str, float], report: Report, batch: int = 32, ctx: int = 8192
) -> None:
    """Decode at batch 32 over 8,192 tokens of context, the KV cache in bf16 then in fp8
    (issue 34): the KV read dominates the step, so an fp8 cache should cut it by about half.
    Batch 32, not 64: 64 sequences of 8k in bf16 (69 GB) do not fit beside the weights on an
    H100."""
    for dtype in ("auto", "fp8"):
        options = {**DENSE, "max_model_len": ctx + 128, "kv_cache_dtype": dtype}
        llm = dummy_llm(folder, **options, kv_cache_tokens=batch * (ctx + 128))
        wbytes = weight_bytes(llm.engine.runner)
        kv_per_token = llm.engine.runner.kv_spec.bytes_per_token

        def decode(llm: Any = llm, wbytes: int = wbytes, kv: int = kv_per_token) -> dict[str, Any]:
            step = decode_step_time(llm.engine, batch, ctx)
            floor = (wbytes + batch * (ctx + 16) * kv) / (ceil["copy_gb_s"] * 1e9)
            return {"batch": batch, "context": ctx, "kv_bytes_per_token": kv,
                    "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                    "ratio_to_floor": step / floor}  # fmt: skip

        report.guarded(f"decode_b{batch}_ctx{ctx}_kv_{dtype}", decode)
        llm.close()
        del llm, decode  # the closure holds the engine too: an H100 cannot hold two
        release_memory()


# The dense model's engine limits (its KV cache size set per use), and --quantization.
DENSE: dict[str, Any] = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)


def offline(llm: Any, ceil: dict[str, float], wbytes: int, kv_per_token: int) -> dict[str, Any]:
    from pdmesh import SamplingParams

    prompts = offline_prompts()
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    seconds, produced = timed_generate(llm, prompts, [128] * len(prompts))[:2]
    cfg = llm.engine.info
    model = llm.engine.runner.model
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    flops = 256 * (2 * params * 512 + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 512**2)
    decode_bytes = sum(wbytes + 256 * (512 + i) * kv_per_token for i in range(128))
    floor = flops / (matmul_rate(ceil) * 1e12) + decode_bytes / (ceil["copy_gb_s"] * 1e9)
    return {
        "requests": 256,
        "output_tokens": produced,
        "seconds": seconds,
        "tok_s": produced / seconds,
        "floor_s": floor,
        "ratio_to_floor": seconds / floor,
    }


def transformers_peer(folder: Path, report: Report) -> None:
    """transformers `generate_batch` (its continuous batching) on the same workload and the
    very weights the engine runs: the engine loads the transformers model's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompts = offline_prompts()
    gen = GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)

    def peer() -> dict[str, Any]:
        hf.generate_batch(inputs=prompts[:2], generation_config=gen)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = hf.generate_batch(inputs=prompts, generation_config=gen)
        seconds = time.perf_counter() - start
        produced = sum(len(o.generated_tokens) for o in outs.values())
        return {"output_tokens": produced, "seconds": seconds, "tok_s": produced / seconds}

    def ours_same_weights() -> dict[str, Any]:
        llm = dummy_llm(folder, **DENSE, kv_cache_tokens=200_000)
        llm.engine.runner.load_tensors(hf.state_dict().items())
        seconds, produced, outputs = timed_generate(llm, prompts, [128] * len(prompts))
        # Same weights: the first tokens agree with transformers' greedy output.
        ref = hf.generate(
            torch.tensor([prompts[0]], device="cuda"), max_new_tokens=8, do_sample=False
        )[0, 512:].tolist()
        return {
            "output_tokens": produced,
            "seconds": seconds,
            "tok_s": produced / seconds,
            "first_8_tokens_match_transformers": outputs[0].outputs[0].token_ids[:8] == ref,
        }

    report.guarded("offline_transformers_generate_batch", peer)
    report.guarded("offline_engine_same_weights", ours_same_weights)


def moe_section(
    folder: Path, ceil: dict[str, float], report: Report, profile_to: Path | None = None
) -> None:
    llm = dummy_llm(
        folder,
        quantization=DENSE.get("quantization"),
        kv_cache_tokens=65_536,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        max_model_len=4096,
    )
    bw = ceil["copy_gb_s"] * 1e9
    runner = llm.engine.runner

    def decode(batch: int) -> dict[str, float]:
        step = decode_step_time(llm.engine, batch, 512)
        touched, touched_bytes = moe_touched_experts(llm.engine, batch, 512)
        kv = batch * 528 * runner.kv_spec.bytes_per_token
        floor = (touched_bytes + kv) / bw
        return {
            "batch": batch,
            "step_ms": step * 1e3,
            "experts_touched_per_layer": touched,
            "bytes_read_gb": (touched_bytes + kv) / 1e9,
            "floor_ms": floor * 1e3,
            "ratio_to_floor": step / floor,
        }

    report.guarded("moe_decode_b1", lambda: decode(1))
    report.guarded("moe_decode_b64", lambda: decode(64))
    if profile_to is not None:  # where a batch-1 step's time goes, kernel by kernel
        kind = DENSE.get("quantization") or "bf16"
        table = profile_decode(llm.engine, 1, 512)
        (profile_to / f"profile-moe-b1-{kind}.txt").write_text(table)


def plot(sweep: Any, out: Path) -> None:
    """Time per output token against batch size, measured and at the roofline."""
    if not isinstance(sweep, list):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["step_ms"] / r["batch"] for r in sweep], "o-", label="pdmesh (measured)")
    floor = [r["floor_ms"] / r["batch"] for r in sweep]
    ax.plot(batches, floor, "--", label="roofline: (weights + KV bytes) / copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (decode, context 1024)")
    ax.set_ylabel("time per output token (ms)")
    kind = DENSE.get("quantization") or "bf16"
    ax.set_title(f"Llama-3.1-8B shape, {kind}, {torch.cuda.get_device_name()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode_roofline.png", dpi=120)


def release_memory() -> None:
    """Free a finished section's models before the next one loads (tens of GB each)."""
    free_memory()
    print(f"GPU memory in use: {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)


def main() -> None:
    parser = out_parser(__doc__)
    parser.add_argument("--only", default="decode,peer,moe")
    parser.add_argument("--quantization", default=None, help="fp8: the engine's weights in FP8")
    parser.add_argument("--profile", action="store_true", help="MoE: a batch-1 step's profile")
    args = parser.parse_args()
    only = set(args.only.split(","))
    DENSE["quantization"] = args.quantization
    report = Report(args.out / f"gpu{'-' + args.quantization if args.quantization else ''}.json")
    report.record("device", run_info("name"))
    ceil = ceilings()
    report.record("ceilings", ceil)
    tmp = Path(tempfile.mkdtemp())
    dense = write_config(tmp / "llama8b", llama_8b_config())
    if "decode" in only:
        dense_section(dense, ceil, report)
        plot(report.data.get("decode_sweep_ctx1024"), args.out)
        release_memory()
    if "longctx" in only:
        long_context_section(dense, ceil, report)
    if "peer" in only:
        transformers_peer(dense, report)
        release_memory()
    if "moe" in only:
        folder = write_config(tmp / "qwen3moe", qwen3_moe_30b_config())
        moe_section(folder, ceil, report, args.out if args.profile else None)
    print("\n" + json.dumps(report.data, indent=1, default=float))


if __name__ == "__main__":
    main()
