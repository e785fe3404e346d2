"""A new engine's first steps, run before it serves: every kernel a request can launch is
compiled (Triton) or loaded (cuBLAS, lazily loaded CUDA modules) now, not in the middle of a
user's step.

Why: on two H200s a decode worker's first local prefill of a 4,096-token prompt compiled kernels
for shapes its decode-graph capture had never run; its streams stalled ~220 ms and the prompt's
TTFT grew 0.5-0.9 s (BENCHMARKS.md, issue 33). vLLM runs a profile forward of the step's token
budget at start for the same reason.

What runs, through the engine's own public path (scheduler, runner, sampler, every rank): a
prompt of the step's whole token budget (the largest prefill step, its GEMMs and attention
tiles), its decode steps (graph replays), and a short sampled prompt beside them (a step mixing
decode and prefill rows, temperature / top-k / top-p sampling). Afterwards the engine is as
new: no request, no cached prefix, its counters and measured prefill rate back at zero.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdmesh.engine.scheduling.burst import PrefillRate
from pdmesh.logger import get_logger
from pdmesh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdmesh.engine.llm_engine import LLMEngine

log = get_logger(__name__)

_LONG, _SHORT = "warm-up-long", "warm-up-short"
_SHORT_PROMPT = 37  # not a multiple of a block or of 16: the general kernel specializations


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to their end; the seconds it took."""
    started = time.perf_counter()
    budget = engine.scheduler.max_num_batched_tokens
    capacity = engine.runner.num_blocks * engine.config.block_size
    # The long prompt fills one step's budget; it and the short one fit the context and cache.
    long_len = max(1, min(budget, engine.max_model_len, capacity) - _SHORT_PROMPT - 8)
    vocab = engine.info.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(long_len)]
    engine.add_request(_LONG, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    short = [(5 * i + 3) % vocab for i in range(min(_SHORT_PROMPT, engine.max_model_len - 2))]
    sampled = SamplingParams(
        max_tokens=2, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=0
    )
    engine.add_request(_SHORT, short, sampled)
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in (_LONG, _SHORT):
        engine.release(request_id)
    engine.scheduler.reset_prefix_cache()
    engine.scheduler.reset_stats()
    engine.prefill_rate = PrefillRate()  # its first sample held the compiles
    seconds = time.perf_counter() - started
    log.info("warmed up in %.2f s (a %d-token prefill step, decode, sampling)", seconds, long_len)
    return seconds
