"""The engine on one GPU against the hardware ceilings and transformers, in one run.

    python -m pdmesh.bench.gpu --out DIR [--only decode,prefill,offline,moe,sweep]

Random-initialised bf16 weights of real model shapes (load_format="dummy"). Ceilings are
measured in the same run: device-to-device copy bandwidth (bytes read + written) and a large
bf16 matmul. Every figure is written to DIR/gpu.json as soon as it is measured; a table is
printed last. See BENCHMARKS.md for what each target means.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import llama_8b_config, qwen3_moe_30b_config, write_config
from pdmesh.bench.gpu_workloads import (
    decode_step_time,
    moe_touched_experts,
    prefill_time,
    weight_bytes,
)

RESULTS: dict[str, Any] = {}


def ceilings() -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s), medians."""
    from triton.testing import do_bench

    n = 1 << 30  # 2 GiB of bf16 each way: far beyond L2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    return {
        "copy_gb_s": 2 * n * 2 / (copy_ms * 1e-3) / 1e9,
        "matmul_tflop_s": 2 * m**3 / (mm_ms * 1e-3) / 1e12,
    }


def record(key: str, value: Any, out: Path) -> None:
    RESULTS[key] = value
    (out / "gpu.json").write_text(json.dumps(RESULTS, indent=2, default=float))
    print(f"[{key}] {json.dumps(value, default=float)}", flush=True)


def guarded(name: str, fn: Callable[[], Any], out: Path) -> None:
    try:
        record(name, fn(), out)
    except Exception as e:
        import traceback

        traceback.print_exc()
        record(name, {"error": f"{type(e).__name__}: {e}"}, out)
    torch.cuda.empty_cache()


def llama_engine(folder: Path, **kw: Any) -> Any:
    from pdmesh import LLM

    options = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    return LLM(str(folder), **{**options, **kw})


def dense_section(folder: Path, ceil: dict[str, float], out: Path) -> None:
    llm = llama_engine(
        folder,
        kv_cache_tokens=300_000,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    )
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

    guarded("decode_b1", lambda: decode(1, 512), out)

    def replay_only() -> dict[str, float]:
        """The batch-1 graph alone (no scheduling, no input copies, no sampling): how much of
        a step is GPU time and how much the host around it."""
        from triton.testing import do_bench

        graphs = llm.engine.runner.graphs
        ms = do_bench(graphs.graphs[1].replay, warmup=20, rep=200, return_mode="median")
        return {
            "graph_replay_ms": ms,
            "floor_ms": wbytes / bw * 1e3,
            "ratio": ms / (wbytes / bw * 1e3),
        }

    guarded("decode_b1_graph_only", replay_only, out)
    guarded("decode_b64_ctx1024", lambda: decode(64, 1024), out)

    def prefill() -> dict[str, float]:
        seconds, flops = prefill_time(llm.engine, 4096)
        rate = flops / seconds / 1e12
        return {
            "tokens": 4096,
            "ms": seconds * 1e3,
            "tflop": flops / 1e12,
            "tflop_s": rate,
            "fraction_of_matmul": rate / ceil["matmul_tflop_s"],
        }

    guarded("prefill_4096", prefill, out)

    def sweep() -> list[dict[str, float]]:
        return [decode(b, 1024) for b in (1, 4, 16, 32, 64, 128, 256)]

    guarded("decode_sweep_ctx1024", sweep, out)
    guarded("offline_engine", lambda: offline(llm, ceil, wbytes, kv_per_token), out)


def offline(llm: Any, ceil: dict[str, float], wbytes: int, kv_per_token: int) -> dict[str, Any]:
    from pdmesh import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(256)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    cfg = llm.engine.info
    flops = 256 * (
        2 * (wbytes / 2) * 512 + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 512**2
    )
    decode_bytes = sum(wbytes + 256 * (512 + i) * kv_per_token for i in range(128))
    floor = flops / (ceil["matmul_tflop_s"] * 1e12) + decode_bytes / (ceil["copy_gb_s"] * 1e9)
    return {
        "requests": 256,
        "output_tokens": produced,
        "seconds": seconds,
        "tok_s": produced / seconds,
        "floor_s": floor,
        "ratio_to_floor": seconds / floor,
    }


def transformers_peer(folder: Path, out: Path) -> None:
    """transformers `generate_batch` (its continuous batching) on the same workload and the
    very weights the engine runs: the engine loads the transformers model's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from pdmesh import SamplingParams

    config = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(256)]
    gen = GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)

    def peer() -> dict[str, Any]:
        hf.generate_batch(inputs=prompts[:2], generation_config=gen)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = hf.generate_batch(inputs=prompts, generation_config=gen)
        seconds = time.perf_counter() - start
        produced = sum(len(o.generated_tokens) for o in outs.values())
        return {"output_tokens": produced, "seconds": seconds, "tok_s": produced / seconds}

    guarded("offline_transformers_generate_batch", peer, out)

    def ours_same_weights() -> dict[str, Any]:
        llm = llama_engine(
            folder,
            kv_cache_tokens=200_000,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=8192,
        )
        llm.engine.runner.load_tensors(hf.state_dict().items())
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
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

    guarded("offline_engine_same_weights", ours_same_weights, out)


def moe_section(folder: Path, ceil: dict[str, float], out: Path) -> None:
    llm = llama_engine(
        folder,
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

    guarded("moe_decode_b1", lambda: decode(1), out)
    guarded("moe_decode_b64", lambda: decode(64), out)


def plot(out: Path) -> None:
    sweep = RESULTS.get("decode_sweep_ctx1024")
    if not isinstance(sweep, list):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["step_ms"] / r["batch"] for r in sweep], "o-", label="pdmesh (measured)")
    ax.plot(
        batches,
        [r["floor_ms"] / r["batch"] for r in sweep],
        "--",
        label="roofline: (weights + KV bytes) / copy bandwidth",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (decode, context 1024)")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(f"Llama-3.1-8B shape, bf16, {torch.cuda.get_device_name()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode_roofline.png", dpi=120)


def release_memory() -> None:
    """Free a finished section's models before the next one loads (tens of GB each)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    print(f"GPU memory in use: {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="decode,peer,moe")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    record(
        "device",
        {
            "name": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        },
        out,
    )
    ceil = ceilings()
    record("ceilings", ceil, out)
    tmp = Path(tempfile.mkdtemp())
    dense = write_config(tmp / "llama8b", llama_8b_config())
    if "decode" in only:
        dense_section(dense, ceil, out)
        plot(out)
        release_memory()
    if "peer" in only:
        transformers_peer(dense, out)
        release_memory()
    if "moe" in only:
        moe_section(write_config(tmp / "qwen3moe", qwen3_moe_30b_config()), ceil, out)
    print("\n" + json.dumps(RESULTS, indent=1, default=float))


if __name__ == "__main__":
    main()
