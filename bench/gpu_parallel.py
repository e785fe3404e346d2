"""Tensor and expert parallelism over NCCL, in bf16: correctness against one GPU, and speed.

    python -m pdmesh.bench.gpu_parallel --out DIR            # on a machine with 2 GPUs
    python -m pdmesh.bench.gpu_parallel --out DIR --tiny     # a dry run on CPU (gloo)

Each model is saved once as a checkpoint so that every configuration loads the very same
weights (each rank reads its own shard). Compared: last-token logits of TP=2 against TP=1
(bf16 tolerance), greedy tokens over 64 steps (and where they first differ, if they do), decode
time per token; for MoE, expert parallelism against TP-only and one GPU, with the all-to-all
time per call measured on rank 0.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import TINY, llama_8b_config, qwen3_moe_30b_config, random_checkpoint
from pdmesh.bench.gpu_workloads import decode_step_time, greedy_tokens, prompts
from pdmesh.bench.report import Report, compare_tokens, free_memory, out_parser, run_info
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.sampling_params import SamplingParams

DTYPE = "bfloat16"


def engine(folder: Path, tp: int, ep: bool = False, eager: bool = False, **kw: Any) -> Any:
    from pdmesh import LLM

    return LLM(
        str(folder),
        dtype=DTYPE,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        enforce_eager=eager,
        **kw,
    )


def last_logits(llm: Any, prompt: list[int]) -> torch.Tensor:
    """Logits of the prompt's last position, computed by every rank together: a step as
    `ModelRunner.launch` runs it, without the sampling."""
    e, runner = llm.engine, llm.engine.runner
    e.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    inputs = runner.prepare(e.scheduler.schedule())
    if runner.followers is not None:
        runner.followers.send_step(inputs, None)
    logits = runner.forward_with_plan(inputs, None)
    e.abort_request("logits")
    e.release("logits")
    return logits[0].float().cpu()


def time_all_to_all(llm: Any, batch: int, ctx: int) -> dict[str, float]:
    """Decode steps with each all-to-all timed on rank 0 (synchronised, so slower overall)."""
    times: list[float] = []
    original = ParallelGroup.all_to_all

    def timed(
        self: ParallelGroup, x: torch.Tensor, send: list[int], recv: list[int]
    ) -> torch.Tensor:
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        out = original(self, x, send, recv)
        sync()
        times.append(time.perf_counter() - start)
        return out

    ParallelGroup.all_to_all = timed  # type: ignore[method-assign]
    try:
        decode_step_time(llm.engine, batch, ctx, steps=6)
    finally:
        ParallelGroup.all_to_all = original  # type: ignore[method-assign]
    return {"calls": len(times), "median_ms_per_call": statistics.median(times) * 1e3}


def one_gpu(
    folder: Path, max_model_len: int, prompt_len: int
) -> tuple[dict[str, Any], list[list[int]], Any]:
    """A comparison's engine options, its 4 prompts of `prompt_len` tokens, and its TP=1 engine."""
    kw = dict(kv_cache_tokens=32768, max_model_len=max_model_len, max_num_batched_tokens=4096)
    one = engine(folder, 1, **kw)
    return kw, prompts(4, prompt_len, 7, one.engine.info.vocab_size), one


def dense(folder: Path, tiny: bool, report: Report) -> None:
    kw, ps, one = one_gpu(folder, 4096, 64 if tiny else 512)
    results: dict[str, Any] = {}
    base_logits = last_logits(one, ps[0])
    base_tokens = greedy_tokens(one, ps, 64)
    results["tp1_step_ms_b1"] = decode_step_time(one.engine, 1, 256) * 1e3
    del one
    free_memory()
    one_eager = engine(folder, 1, eager=True, **kw)
    results["tp1_eager_step_ms_b1"] = decode_step_time(one_eager.engine, 1, 256) * 1e3
    del one_eager
    free_memory()
    with engine(folder, 2, **kw) as two:
        logits = last_logits(two, ps[0])
        tokens = greedy_tokens(two, ps, 64)
        results["tp2_step_ms_b1"] = decode_step_time(two.engine, 1, 256) * 1e3
    diff = (logits - base_logits).abs()
    results.update(
        logits_max_abs_diff=float(diff.max()),
        logits_rel_err=float((logits - base_logits).norm() / base_logits.norm()),
        logits_argmax_equal=bool(logits.argmax() == base_logits.argmax()),
        greedy_64_steps=compare_tokens(base_tokens, tokens),
        tp2_over_tp1=results["tp2_step_ms_b1"] / results["tp1_step_ms_b1"],
        tp2_over_tp1_eager=results["tp2_step_ms_b1"] / results["tp1_eager_step_ms_b1"],
    )
    report.record(f"dense_tp2_vs_tp1_{DTYPE}", results)


def moe(folder: Path, tiny: bool, report: Report) -> None:
    kw, ps, one = one_gpu(folder, 2048, 64 if tiny else 256)
    results: dict[str, Any] = {}
    base = greedy_tokens(one, ps, 64)
    results["tp1_step_ms_b64"] = decode_step_time(one.engine, 64, 256) * 1e3
    del one
    free_memory()
    for name, ep in (("tp2", False), ("ep2", True)):
        with engine(folder, 2, ep=ep, **kw) as llm:
            tokens = greedy_tokens(llm, ps, 64)
            step = decode_step_time(llm.engine, 64, 256)
            entry = {
                "greedy_64_steps_vs_tp1": compare_tokens(base, tokens),
                "step_ms_b64": step * 1e3,
                "tok_s_b64": 64 / step,
            }
            if ep:
                entry["all_to_all"] = time_all_to_all(llm, 64, 256)
                entry["all_to_all_calls_counted"] = llm.engine.runner.tp.counters["all_to_all"]
            results[name] = entry
    report.record(f"moe_parallel_{DTYPE}", results)


def main() -> None:
    parser = out_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a dry run)")
    parser.add_argument("--only", default="dense,moe")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 for exactness")
    args = parser.parse_args()
    global DTYPE
    DTYPE = args.dtype
    device = "cpu" if args.tiny else "cuda"
    report = Report(args.out / "parallel.json")
    report.record("device", {**run_info("name"), "gpus": torch.cuda.device_count()})
    tmp = Path(tempfile.mkdtemp())

    def checkpoint(config: Any, name: str) -> Path:
        """Saved once: every configuration loads the very same weights."""
        return random_checkpoint(config, tmp / name, 0.02, device, torch.bfloat16)

    if "dense" in args.only:
        config = llama_8b_config()
        if args.tiny:
            config.update(TINY)
        dense(checkpoint(config, "dense"), args.tiny, report)
    if "moe" in args.only:
        config = qwen3_moe_30b_config()
        # 12 of the 48 layers: same per-layer shapes, a quarter of the 61 GB to write and load.
        config.num_hidden_layers = 12
        if args.tiny:
            config.update(TINY | dict(moe_intermediate_size=32, head_dim=16, num_experts=8))
        moe(checkpoint(config, "moe"), args.tiny, report)


if __name__ == "__main__":
    main()
