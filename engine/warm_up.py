"""A new engine's first steps, run before it serves: every kernel a request can launch is
compiled (Triton) or loaded (cuBLAS, lazily loaded CUDA modules) now, not in the middle of a
user's step.

Why: on two H200s a decode worker's first local prefill of a 4,096-token prompt compiled kernels
for shapes its decode-graph capture had never run; its streams stalled ~220 ms and the prompt's
TTFT grew 0.5-0.9 s (BENCHMARKS.md, issue 33). vLLM runs a profile forward of the step's token
budget at start for the same reason.

What runs, through the engine's own public path (scheduler, runner, sampler, every rank): a
prompt of the step's whole token budget alone (the largest prefill step, its GEMMs and attention
tiles); then two prompts in one step, their decode steps (graph replays), and two more prompts
joining them (steps mixing several decode rows with prefill rows), one of them sampled with
temperature, top-k and top-p. Triton compiles a kernel anew for an integer argument equal to 1,
divisible by 16, or neither: the token and row counts here take each class. Afterwards the
engine is as new: no request, no cached prefix, its counters and measured prefill rate at zero.
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


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return [(seed + 7 * i) % vocab for i in range(length)]


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to their end; the seconds it took."""
    started = time.perf_counter()
    # max_model_len is within the KV cache already (LLMEngine lowers it to the cache's size).
    room = min(engine.scheduler.max_num_batched_tokens, engine.max_model_len) - 8
    vocab = engine.info.vocab_size
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=3, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=0
    )
    # The whole budget in one prompt, a multiple of 16 tokens.
    waves = [[(max(16, room // 16 * 16), greedy)]]
    # Two prompts in a step (an odd total); two more join their decodes a step later.
    waves += [[(max(1, room // 4), greedy), (37, greedy)], [(64, sampled), (45, greedy)]]
    ids = []
    for w, wave in enumerate(waves):
        for i, (length, params) in enumerate(wave):
            ids.append(f"warm-up-{w}-{i}")
            prompt = _prompt(min(length, engine.max_model_len - 4), 11 + w + 3 * i, vocab)
            engine.add_request(ids[-1], prompt, params)
        engine.step()
        if w == 0:  # the long prompt runs alone
            while engine.has_unfinished_requests():
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in ids:
        engine.release(request_id)
    engine.scheduler.reset_prefix_cache()
    engine.scheduler.reset_stats()
    engine.steps.prefill_rate = PrefillRate()  # its first samples held the compiles
    engine.steps.most_in_flight = 0
    seconds = time.perf_counter() - started
    log.info("warmed up in %.2f s (a %d-token prefill step, decode, sampling)", seconds, room)
    return seconds
