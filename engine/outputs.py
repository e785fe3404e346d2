"""What the engine hands back: per-step deltas for streaming, whole results for offline use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and its rank among the vocabulary (1: the most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per position: the token there and the alternatives asked for, by token id (vLLM's shape).
PositionLogprobs = dict[int, Logprob]


class StepDelta(NamedTuple):
    """One choice's progress in one engine step (what a streaming server forwards). A request
    with n > 1 or best_of has a delta per sequence and step; `finish_reason` ends the choice
    `index`, and `request_finished` marks the request's last delta (every choice has ended;
    with n > 1 several may end in one step, and only the last of them carries it)."""

    request_id: str
    token_ids: list[int]
    text: str
    # None while the choice runs; "stop", "length", "abort", or "error": the engine ended the
    # request early (RequestOutput.error says why) while the rest of its batch ran on.
    finish_reason: str | None
    # One per token of token_ids when the request asks for log-probabilities (or when best_of >
    # n ranks its sequences by them: then the token's own entry, asked for or not).
    logprobs: list[PositionLogprobs] | None = None
    # With a request's first token when asked for: one per prompt token, None for the first.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # The sequence: the choice 0 .. n-1; with best_of > n, the candidate 0 .. best_of-1 (not
    # streamed to clients: the n returned are chosen at the end, see RequestOutput).
    index: int = 0
    request_finished: bool = False


def mark_request_ends(
    deltas: list[StepDelta], is_finished: Callable[[str], bool]
) -> list[StepDelta]:
    """`deltas` with `request_finished` set on the last one of each request whose every choice
    has ended by then."""
    seen: set[str] = set()
    for i in range(len(deltas) - 1, -1, -1):
        d = deltas[i]
        if d.request_id not in seen:
            seen.add(d.request_id)
            if d.finish_reason is not None and is_finished(d.request_id):
                deltas[i] = d._replace(request_finished=True)
    return deltas


@dataclass(frozen=True)
class FirstTokens:
    """What a prefill worker hands back with a prompt's KV: the first token of each choice, and
    the log-probabilities it computed when the request asks for them."""

    token_ids: list[int]  # one per sequence (best_of, else n), by the deltas' index
    logprobs: list[PositionLogprobs] | None = None  # one per sequence
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # one per prompt token


# Sampled "tokens" the model runner reports for a row it could not sample; the engine loop
# then ends that request alone (engine/scheduling/request.py).
NO_ALLOWED_TOKEN = -1  # every token's logit was -inf: the request's constraints left none
NON_FINITE_LOGITS = -2  # the row held NaN or +inf


@dataclass(frozen=True)
class RequestError:
    """Why the engine ended one request early, its batch running on: the name of a gRPC status
    (INVALID_ARGUMENT: the request's own constraints left nothing to sample; INTERNAL: a fault
    while serving it), a sentence for the client, and the request field it names, if any."""

    status: str
    message: str
    field: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per token, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # One per prompt token, None for the first (nothing predicts it), when asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Set when the engine ended the request early (its choices' finish_reason is "error").
    error: RequestError | None = None


@dataclass(frozen=True)
class EngineStats:
    """An engine's load and counters since start (read from any thread: plain numbers), under
    the names of the WorkerStats message."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    steps_launched_ahead: int
    # The host-memory KV tier (engine/kv_cache/host/index.py); zeros when it is off.
    host_tier_blocks_total: int = 0  # slots
    host_tier_blocks_used: int = 0
    host_tier_hit_blocks: int = 0  # prompt blocks loaded from it instead of recomputed
    host_tier_hit_tokens: int = 0
    host_tier_offloaded_bytes: int = 0  # KV of every layer and head, over the worker's ranks
    host_tier_loaded_bytes: int = 0
    host_tier_copy_seconds: float = 0.0  # rank 0's copies, both ways (GPU: as far as finished)
    # Speculative decoding (engine/spec_decode/speculator.py); zeros when it is off: draft tokens
    # run by verify steps, and those accepted (output).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class ForkStats(NamedTuple):
    """What requests with several sequences (n, best_of) saved, since start."""

    blocks_shared: int  # prompt block references forked sequences took instead of new blocks
    blocks_copied: int  # shared, partly filled blocks copied on a sequence's first write
