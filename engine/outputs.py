"""What the engine hands back: per-step deltas for streaming, whole results for offline use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pdmesh.engine.sequence import Sequence


class StepDelta(NamedTuple):
    """One request's progress in one engine step (what a streaming server forwards)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while the request runs; "stop", "length" or "abort"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Reservation:
    """Blocks held for a prompt whose KV another worker computes (see `reserve_prefill`)."""

    seq: Sequence
    first_block: int  # prompt blocks already here (prefix cache): not to be sent
    block_ids: list[int]  # this worker's blocks for the rest of the prompt, in order

    @property
    def uncached_tokens(self) -> int:
        return self.seq.num_tokens - self.seq.num_computed_tokens


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    steps_launched_ahead: int
