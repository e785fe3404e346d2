"""Timed pieces of the engine benchmarks: decode steps, a prefill, a batch of generations, MoE
expert traffic."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from pdmesh.sampling_params import SamplingParams

_ids = iter(range(10**9))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def weight_bytes(runner: Any) -> int:
    """Bytes a decode step reads from weights: all but the (gathered, not scanned) embedding."""
    total = 0
    for name, p in runner.model.named_parameters():
        if "embed_tokens" in name and not runner.model.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `length` random ordinary token ids (above the tenth of the vocabulary where
    special and byte tokens live)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab // 10, vocab) for _ in range(length)] for _ in range(n)]


def timed_generate(
    llm: Any, token_prompts: list[list[int]], output_lens: list[int]
) -> tuple[float, int, list[Any]]:
    """(seconds, tokens produced, outputs) of one `generate` call that makes exactly
    `output_lens` tokens (greedy, ignore_eos) for token-id prompts."""
    params = [_greedy(n) for n in output_lens]
    inputs = [{"prompt_token_ids": p} for p in token_prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), outputs


def greedy_tokens(llm: Any, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Exactly `max_tokens` greedy tokens (ignore_eos) after each token-id prompt."""
    outputs = timed_generate(llm, token_prompts, [max_tokens] * len(token_prompts))[2]
    return [o.outputs[0].token_ids for o in outputs]


def _admit(engine: Any, batch: int, ctx: int, max_tokens: int) -> list[str]:
    ids = []
    for prompt in prompts(batch, ctx, batch * 7919 + ctx, engine.info.vocab_size):
        rid = f"bench-{next(_ids)}"
        engine.add_request(rid, prompt, _greedy(max_tokens))
        ids.append(rid)
    # Run until every prompt is prefilled (each has its first token); read from the steps'
    # deltas, which a data-parallel front has for every replica's requests.
    first = set()
    while len(first) < len(ids):
        first.update(d.request_id for d in engine.step() if d.token_ids)
    return ids


def _decoding(engine: Any, batch: int, ctx: int, steps: int) -> list[str]:
    """`batch` requests admitted with room for `steps` more decode steps, after 4 warm-up ones."""
    ids = _admit(engine, batch, ctx, max_tokens=steps + 12)
    for _ in range(4):
        engine.step()
    _sync()
    return ids


def _drain(engine: Any, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
        engine.release(rid)


def decode_step_time(engine: Any, batch: int, ctx: int, steps: int = 24) -> float:
    """Seconds per decode step of `batch` sequences at about `ctx` tokens of context: the
    mean over `steps` back-to-back steps after 4 warm-up ones. Back to back, as a serving loop
    runs them: with async scheduling a step's host work overlaps the next step's device work,
    which a sync before each step would undo."""
    ids = _decoding(engine, batch, ctx, steps)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # reads a step's sampled tokens back: its one host sync
    elapsed = time.perf_counter() - start
    _drain(engine, ids)
    return elapsed / steps


def profile_decode(engine: Any, batch: int, ctx: int, steps: int = 8) -> str:
    """torch.profiler tables (GPU kernels by total time, host ops by self time) of `steps`
    decode steps, after warm-up ones: where a step's time goes on this process's rank."""
    from torch.profiler import ProfilerActivity, profile

    ids = _decoding(engine, batch, ctx, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    _drain(engine, ids)
    table = prof.key_averages()
    return (
        f"{steps} decode steps, batch {batch}\n"
        + table.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
        + "\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    )


def prefill_time(engine: Any, tokens: int) -> tuple[float, float]:
    """(median seconds, FLOPs) of prefilling one prompt of `tokens` tokens in one step."""
    info = engine.info
    layers, heads, head_dim = info.num_layers, info.num_heads, info.head_dim
    params = sum(p.numel() for n, p in engine.runner.model.named_parameters() if "embed" not in n)
    flops = 2 * params * tokens + 2 * layers * heads * head_dim * tokens**2  # causal attention
    times = []
    for i in range(5):
        rid = f"prefill-{next(_ids)}"
        prompt = prompts(1, tokens, 1000 + i, info.vocab_size)[0]
        engine.add_request(rid, prompt, _greedy(1))
        _sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
        engine.release(rid)
    engine.scheduler.reset_prefix_cache()
    return statistics.median(times[1:]), flops


def moe_touched_experts(engine: Any, batch: int, ctx: int) -> tuple[float, int]:
    """(experts touched per MoE layer in one decode step, bytes of weights it reads), counted by
    running one step eagerly: the experts whose routed-pair counts (`expert_counts`) grew."""
    from pdmesh.engine.layers.moe import FusedMoE

    runner = engine.runner
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    graphs, runner.graphs = runner.graphs, None
    ids = _admit(engine, batch, ctx, max_tokens=4)
    before = [m.expert_counts.clone() for m in moes]
    engine.step()
    touched = [int((m.expert_counts > b).sum()) for m, b in zip(moes, before, strict=True)]
    runner.graphs = graphs
    _drain(engine, ids)
    per_layer = sum(touched) / len(touched)
    m = moes[0]
    expert_bytes = (m.w13_weight[0].numel() + m.w2_weight[0].numel()) * m.w13_weight.element_size()
    other = sum(
        p.numel() * p.element_size()
        for n, p in runner.model.named_parameters()
        if "w13_weight" not in n and "w2_weight" not in n and "embed_tokens" not in n
    )
    return per_layer, int(sum(touched) * expert_bytes + other)
