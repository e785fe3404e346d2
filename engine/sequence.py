"""A request as the engine sees it: its tokens, its KV blocks and how far the KV is computed."""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from pdmesh.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # blocks held, KV arriving from a prefill worker
    # A choice of a request with n > 1 (or best_of) waiting for its prompt: it is forked from
    # the request's first sequence, sharing its blocks, when that one's prompt is computed.
    FORK_PENDING = "fork_pending"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output) and the progress of their KV cache.

    `num_computed_tokens` tokens have their KV in `block_table`; the scheduler runs the next
    `num_tokens - num_computed_tokens` of them (a prefill chunk, or the last sampled token).
    When the KV covers every token, the step samples one more.

    A request resumed on this worker after another was lost comes with the output it had
    produced appended to its prompt: the last `num_output_tokens` of `prompt_token_ids` then
    count as output (for max_tokens, stop rules and usage), not as prompt.

    A request with several sequences (`params.num_sequences`, see SamplingParams.n) has one per
    choice, `index` 0 .. k-1. Choice 0 runs the prompt; the others wait in its `forks`
    (FORK_PENDING) until the step that completes its prompt, where they take a reference to
    each of its blocks and sample their first token from the same logits. Choice i's seed is
    `params.seed + i`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        num_output_tokens: int = 0,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids) - num_output_tokens
        self.params = params
        self.status = SequenceStatus.WAITING if index == 0 else SequenceStatus.FORK_PENDING
        # The request's other choices, forked from this one when its prompt is computed.
        self.forks: list[Sequence] = []
        self.finish_reason: str | None = None
        # Tokens whose KV lives in the cache, and the blocks holding it.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Hashes of the full blocks published to the prefix cache (a chain: each has its parent).
        self.block_hashes: list[int] = []
        # Prompt tokens served from the prefix cache when first admitted.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        # The structured-output matcher (xgrammar.GrammarMatcher), advanced by each token.
        self.grammar: Any = None
        # Speculative decoding (engine/spec_decode/speculator.py): draft tokens proposed to follow
        # token_ids, run by the next step after its last token and verified there; not part of
        # token_ids (the accepted ones are appended), cleared once the step is handled.
        self.spec_token_ids: list[int] = []
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_seqs(self) -> int:
        """Sequence slots this one takes once running: itself and the choices it forks into."""
        return 1 + len(self.forks)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        choice = f"[{self.index}]" if self.index else ""
        return (
            f"Sequence({self.request_id!r}{choice}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
            f"{self.status.value})"
        )
