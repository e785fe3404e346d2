"""The host-memory KV tier on one GPU, Llama-3.1-8B shape (random bf16 weights): how fast it loads
blocks back against the pinned host-to-device copy ceiling, and the TTFT of a long prefix found
there against recomputing it.

`python -m pdmesh.bench.host_tier_gpu [--prefix-tokens 16384] [--json-out F]` (`--tiny`: the
tiny shape on the CPU, a dry run of the script). In one process:

- ceiling: one pinned host buffer copied to the device as one copy (`copy_(non_blocking)`),
  timed with CUDA events, median of several;
- load bandwidth: the engine's own load path (`HostPool._load`: the slots' KV staged on the
  device, then scattered into cache blocks) over the same bytes, timed the same way; and its
  offload path (`HostPool._offload`, blocks gathered, then copied to their slots) likewise;
- TTFT: `LLM.generate` of a prompt of `--prefix-tokens` random tokens with max_tokens=1, once
  computed from scratch (fresh prompts) and once with its prefix in the host tier (two other
  prompts of the same length evicted it from the device cache first). The figures are medians
  of `--repeats`; the host-tier runs check that every full block but the last came from the
  tier (`host_tier_hit_tokens`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import TINY, decoder_config, dummy_llm, write_config, write_llama_8b
from pdmesh.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _median_s(fn: Any, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def copy_ceiling(nbytes: int, device: torch.device, repeats: int) -> float:
    """Bytes per second of one pinned host -> device copy of `nbytes` (random bytes)."""
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_s(lambda: dev.copy_(host, non_blocking=True), repeats, device)


def load_bandwidth(llm: Any, num_blocks: int, repeats: int) -> tuple[float, int, float, float]:
    """Bytes per second of the host tier's load path moving `num_blocks` slots into as many
    cache blocks (random KV); the bytes moved; bytes per second of its offload path (blocks
    to slots); bytes per second (both directions counted) of a step's copies offloading those
    blocks while loading into them."""
    runner = llm.engine.runner
    pool, cache = runner.host_pool, runner.kv_cache.data
    n = min(num_blocks, pool.num_slots, runner.num_blocks)
    pool.data[:n].view(torch.int16).random_(-(2**14), 2**14)  # finite bf16 bit patterns
    blocks = random.Random(0).sample(range(runner.num_blocks), n)
    loads = [x for slot, block in zip(range(n), blocks, strict=True) for x in (slot, block)]
    nbytes = pool.data[:n].numel() * pool.data.element_size()
    seconds = _median_s(lambda: pool._load(cache, loads), repeats, cache.device)
    # The other direction, as a hit's step runs it first for the cached blocks it evicts.
    offloads = [x for slot, block in zip(range(n), blocks, strict=True) for x in (block, slot)]
    out_seconds = _median_s(lambda: pool._offload(cache, offloads), repeats, cache.device)
    # Both at once, as a hit's step runs them: the blocks' KV out to other slots while the
    # slots' KV comes into the same blocks (`HostPool.copy`: pipelined on a GPU).
    n = min(n, pool.num_slots // 2)
    swap_out = [x for i, block in enumerate(blocks[:n]) for x in (block, n + i)]
    swap_seconds = _median_s(
        lambda: pool.copy(cache, swap_out, loads[: 2 * n]), repeats, cache.device
    )
    swap_bytes = 2 * n * pool.data[0].numel() * pool.data.element_size()
    runner.kv_cache.data.zero_()  # nothing cached refers to those blocks' old KV any more
    llm.engine.scheduler.reset_prefix_cache()
    return nbytes / seconds, nbytes, nbytes / out_seconds, swap_bytes / swap_seconds


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the one token of `prompt`, and that token."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)
    return time.perf_counter() - began, out.outputs[0].token_ids[0]


def _copy_seconds(pool: Any) -> float:
    """The host tier's copy seconds so far, every queued copy finished and counted."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pool._fold()
    return pool.seconds


def ttfts(llm: Any, tokens: int, vocab: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(tokens)]

    _ttft(llm, prompt())  # warm-up: the long prompt's shapes
    # And a short prompt's (a hit's step prefills one block: attention tiles for a query of at
    # most 64 tokens). The first host-tier hit of a process still takes ~1 s more than the
    # others, outside its copies (`host_tier_copy_runs_s`); the median leaves it out.
    _ttft(llm, prompt()[:32])
    pool = llm.engine.runner.host_pool
    recompute, hit, same, hit_tokens, copy_s = [], [], [], [], []
    for _ in range(repeats):
        p = prompt()
        seconds, first = _ttft(llm, p)
        recompute.append(seconds)
        for _ in range(2):  # two prompts as long as the cache: every block of p leaves it
            _ttft(llm, prompt())
        before = llm.engine.stats().host_tier_hit_tokens
        copied = _copy_seconds(pool)
        seconds, again = _ttft(llm, p)
        hit.append(seconds)
        copy_s.append(_copy_seconds(pool) - copied)
        hit_tokens.append(llm.engine.stats().host_tier_hit_tokens - before)
        same.append(again == first)
    return {
        "recompute_ttft_s": statistics.median(recompute),
        "host_tier_ttft_s": statistics.median(hit),
        "speedup": statistics.median(recompute) / statistics.median(hit),
        "recompute_runs_s": recompute,
        "host_tier_runs_s": hit,
        "host_tier_hit_tokens": hit_tokens,
        "host_tier_copy_runs_s": copy_s,
        "first_token_same": same,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-tokens", type=int, default=16384)
    p.add_argument("--load-blocks", type=int, default=512, help="blocks of the bandwidth runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (a dry run)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    tokens = args.prefix_tokens
    folder = Path(tempfile.mkdtemp())
    if args.tiny:
        write_config(folder, decoder_config("LlamaConfig", tuple(TINY.values())))
        options: dict[str, Any] = dict(device="cpu", dtype="float32")
    else:
        write_llama_8b(folder)
        options = {}
    # The device cache holds 1.25 prompts: two more prompts evict every block of the first.
    cache_tokens = tokens + tokens // 4
    block_bytes_est = 2 * 32 * 8 * 128 * 2 * 16 if not args.tiny else 2 * 2 * 2 * 16 * 4 * 16
    gib = 3.5 * tokens / 16 * block_bytes_est / 2**30
    llm = dummy_llm(
        folder,
        kv_cache_tokens=cache_tokens,
        kv_offload_gib=gib,
        max_model_len=tokens + 16,
        **options,
    )
    device = llm.engine.runner.kv_cache.data.device
    vocab = llm.engine.info.vocab_size
    load_bps, load_bytes, offload_bps, swap_bps = load_bandwidth(
        llm, args.load_blocks, args.repeats
    )
    ceiling_bps = copy_ceiling(load_bytes, device, args.repeats)
    figures = ttfts(llm, tokens, vocab, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "shape": "tiny" if args.tiny else "Llama-3.1-8B (random bf16 weights)",
        "prefix_tokens": tokens,
        "load_bytes": load_bytes,
        "load_GBps": load_bps / 1e9,
        "ceiling_GBps": ceiling_bps / 1e9,
        "load_over_ceiling": load_bps / ceiling_bps,
        "offload_GBps": offload_bps / 1e9,
        "offload_and_load_GBps": swap_bps / 1e9,
        **figures,
    }
    print(json.dumps(report, indent=2))
    print(
        f"\n{name}: host-tier load {load_bps / 1e9:.1f} GB/s of a {ceiling_bps / 1e9:.1f} GB/s "
        f"pinned H2D ceiling ({load_bps / ceiling_bps:.2f}), offload {offload_bps / 1e9:.1f} GB/s, "
        f"both at once {swap_bps / 1e9:.1f} GB/s; "
        f"TTFT of a {tokens}-token prefix: "
        f"recompute {figures['recompute_ttft_s'] * 1000:.0f} ms, host tier "
        f"{figures['host_tier_ttft_s'] * 1000:.0f} ms ({figures['speedup']:.1f}x)"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
