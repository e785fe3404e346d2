"""EPLB on the CPU: a skewed-routing MoE at EP=2, imbalance before and after, tokens/s on and off.

`python -m pdmesh.bench.eplb_cpu [--prompts 16] [--prompt-len 96] [--max-tokens 32]
[--data-parallel]` (`--data-parallel`: the experts over two data-parallel replicas, each with its
own requests, instead of two tensor-parallel ranks). The model
is a random Qwen3-MoE (`make_moe`) whose router favours two experts, both held by rank 0 at
start: every token's hidden state has a large constant component (one embedding column), and
the gate rows of the hot experts have a large weight on it. Two engines in turn on the same
cores, greedy, the same prompts: EPLB off, then on (rebalancing every `--interval` steps), the
pair `--repeats` times (other work on the machine moves single figures); medians reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.gpu_models import save_word_tokenizer


def make_moe(
    folder: Path,
    *,
    hidden: int = 96,
    heads: int = 6,
    kv_heads: int = 6,
    layers: int = 3,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 32,
    vocab: int = 512,
    skew: float = 0.0,
    anchor: float = 1.0,
    hot: tuple[int, ...] = (2, 3),
    seed: int = 0,
    dtype: str | None = None,
) -> Path:
    """A random Qwen3-MoE saved in `folder` (its middle layer dense, as Qwen3-MoE allows).
    skew > 0: every token's embedding gets a constant component `anchor` (column 0), and experts
    `hot` that much extra router logit per unit of it, so most tokens route to them. dtype: the
    saved weights' (default float32)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        moe_intermediate_size=moe_intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        mlp_only_layers=[layers // 2] if layers > 2 else [],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # larger than the default init: the argmax depends on every layer
                p.normal_(0.0, 0.08)
        if skew:
            model.model.embed_tokens.weight[:, 0] = anchor  # [V, H]: a constant component
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)  # the router: weight [E, H]
                if gate is not None:
                    gate.weight[list(hot), 0] += skew
    if dtype is not None:  # saved as `dtype` (e.g. "bfloat16": half the bytes to write)
        model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    save_word_tokenizer(folder, vocab)
    return folder


def run_engine(
    folder: Path,
    prompts: list[list[int]],
    max_tokens: int,
    step_times: bool = False,
    **options: Any,
) -> dict:
    """One engine (`options`; 8,192 KV tokens unless given) on `prompts`, greedy, after a short
    warm-up: seconds, tokens/s, every output's token ids, and `eplb_figures` (None: EPLB off).
    step_times: also the decode steps' wall times as rank 0 sees them (p50 / p90 / max, ms;
    every rank's step ends together, at the slowest rank's pace, the MoE layers' exchange
    joining them)."""
    from pdmesh import LLM, SamplingParams
    from pdmesh.bench.step_watch import StepWatch

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    steps = None
    with LLM(str(folder), **{"kv_cache_tokens": 8192, **options}) as llm:
        llm.generate(inputs[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        # No profiled window (it would start past the run's last step).
        watch = StepWatch(llm.engine, folder / "steps", first=1 << 30) if step_times else None
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if watch is not None:
            steps = watch.finish().get("decode_step_ms")
        stats = llm.engine.eplb_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
        "outputs": [o.outputs[0].token_ids for o in outputs],
        "eplb": eplb_figures(stats) if stats is not None else None,
        "decode_step_ms": steps,
    }


def eplb_figures(stats: Any) -> dict[str, Any]:
    """An `EplbStats`' figures as JSON: rebalances, slots moved, the imbalance of the first
    placement (the only one when nothing was rebalanced yet) and of each one after it."""
    return {
        "rebalances": stats.rebalances,
        "experts_moved": stats.experts_moved,
        "rebalance_seconds": round(stats.rebalance_seconds, 3),
        "imbalance_before": round((*stats.imbalance_history, stats.imbalance)[0], 3),
        "imbalance_after": [round(x, 3) for x in (*stats.imbalance_history[1:], stats.imbalance)],
    }


def main() -> None:
    import random

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--anchor", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-parallel", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_moe(
            Path(tmp), hidden=512, heads=8, kv_heads=8, layers=4, moe_intermediate=512,
            skew=args.skew, anchor=args.anchor,
        )  # fmt: skip
        ranks = "data_parallel_size" if args.data_parallel else "tensor_parallel_size"
        ep = {ranks: 2, "enable_expert_parallel": True}
        eplb = dict(
            enable_eplb=True,
            num_redundant_experts=2,
            eplb_window_size=args.interval,
            eplb_step_interval=args.interval,
        )
        offs, ons = [], []
        for _ in range(args.repeats):
            offs.append(run_engine(folder, prompts, args.max_tokens, **ep))
            ons.append(run_engine(folder, prompts, args.max_tokens, **ep, **eplb))
    off, on = offs[0], ons[0]
    print(
        json.dumps(
            {
                "device": f"CPU, {os.cpu_count()} cores ({platform.machine()})",
                "workload": vars(args),
                "eplb_off_tokens_per_s": statistics.median(r["tokens_per_s"] for r in offs),
                "eplb_on_tokens_per_s": statistics.median(r["tokens_per_s"] for r in ons),
                "runs_off": [r["tokens_per_s"] for r in offs],
                "runs_on": [r["tokens_per_s"] for r in ons],
                "same_tokens": all(r["outputs"] == off["outputs"] for r in (*offs, *ons)),
                **on["eplb"],
                "generate_seconds": on["seconds"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
