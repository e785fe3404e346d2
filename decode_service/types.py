"""The decode worker's domain messages (protobuf lives only in the servicer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdmesh.sampling_params import SamplingParams

# One position's log-probabilities: token id -> the engine's Logprob (the token there first).
Position = dict[int, Any]


@dataclass(frozen=True)
class MigrateFrom:
    """A running request a draining decode worker hands over (live migration)."""

    address: str  # that worker's gRPC address
    handle: str  # what it named the request in its `Delta.moved`


@dataclass(frozen=True)
class Submission:
    request_id: str
    subscriber_id: str
    prompt: list[int]
    params: SamplingParams
    prefill_address: str | None  # None: prefill here
    disagg_min_tokens: int  # prefill here when fewer uncached prompt tokens than this
    deadline: float | None  # unix seconds
    arrival_ns: int  # unix ns, when the router received the request
    # The prompt's last tokens are output a lost decode worker already streamed (a failover).
    num_output_tokens_sent: int = 0
    # Pull the KV of every token but the last from a draining worker (None: compute it).
    migrate_from: MigrateFrom | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Timings:
    queue_ns: int
    prefill_ns: int
    first_token_ns: int
    decode_ns: int
    total_ns: int
    disaggregated: bool


@dataclass(frozen=True)
class Delta:
    """A request's news from one step, as subscribers receive it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None = None
    timings: Timings | None = None
    error_status: str = ""  # the status name of a pdmesh.errors class when the request failed
    error_message: str = ""
    error_field: str = ""  # the request field an INVALID_ARGUMENT names, if any
    logprobs: list[Position] | None = None  # one per token, when asked for
    prompt_logprobs: list[Position | None] | None = None  # with the first token, when asked
    index: int = 0  # the choice (n > 1)
    # The request leaves this worker (it drains): its handle for `Migrate`, or "" when there is
    # nothing to pull (the next worker computes it). The request's last delta here.
    moved: str | None = None

    @property
    def ends_request(self) -> bool:
        """The request's last delta (every choice has ended) is the one with its usage; with
        n > 1 a finish reason before it ends only its choice."""
        return self.usage is not None


@dataclass
class RequestClock:
    """Wall-clock milestones of one request (unix ns)."""

    arrival_ns: int
    admitted_ns: int
    disaggregated: bool = False
    first_token_ns: int = 0
    last_token_ns: int = 0  # when its latest tokens came (inter-token latency)
