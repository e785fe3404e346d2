"""A request's several sequences (SamplingParams.n and best_of): the ones it starts with, and
what this worker can ever hold of them.

The sequences of a request share its prompt's KV blocks (see engine/scheduling/scheduler.py): at the
end each holds the prompt's full blocks by reference, and a block of its own for the partly filled
last prompt block (copied on write) and for each block its output fills.
"""

from __future__ import annotations

from typing import NamedTuple

from pdmesh.engine.outputs import FirstTokens
from pdmesh.engine.sequence import Sequence
from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import SamplingParams


class Limits(NamedTuple):
    """What one worker can hold at once."""

    max_model_len: int
    block_size: int
    num_blocks: int  # in the KV cache
    max_num_seqs: int


def choices_field(params: SamplingParams) -> str:
    """The field that sets how many sequences run: best_of when it asks for more than n."""
    return "best_of" if params.ranks_sequences else "n"


def blocks_at_end(num_prompt_tokens: int, max_new_tokens: int, seqs: int, block_size: int) -> int:
    """KV blocks `seqs` sequences hold at most at once: the prompt's full blocks shared, the
    rest (partial prompt block included) one set per sequence."""
    shared = num_prompt_tokens // block_size
    own = -(-(num_prompt_tokens + max_new_tokens) // block_size) - shared
    return shared + seqs * own


def check_choices(
    params: SamplingParams,
    num_prompt_tokens: int,
    num_output_tokens: int,
    limits: Limits,
) -> None:
    """Refuse (InvalidRequest naming n or best_of) sequences this worker can never run together:
    more than its sequence slots, or more KV blocks at their longest than its cache holds."""
    seqs = params.num_sequences
    if seqs == 1:
        return  # one sequence always fits: max_model_len is within the cache
    name = choices_field(params)
    if num_output_tokens:
        raise InvalidRequest(
            f"{name} must be 1 for a resumed request (num_output_tokens_sent > 0).", name
        )
    max_model_len, block_size, num_blocks, max_num_seqs = limits
    if seqs > max_num_seqs:
        raise InvalidRequest(
            f"{name}={seqs} sequences exceed this worker's max_num_seqs ({max_num_seqs}); "
            f"lower {name}.",
            name,
        )
    new_tokens = min(params.max_tokens, max_model_len - num_prompt_tokens)
    need = blocks_at_end(num_prompt_tokens, new_tokens, seqs, block_size)
    if need > num_blocks:
        raise InvalidRequest(
            f"{name}={seqs} sequences of up to {new_tokens} tokens after a "
            f"{num_prompt_tokens}-token prompt need {need} KV blocks of {block_size} tokens; "
            f"this worker's KV cache holds {num_blocks}: lower {name} or max_tokens.",
            name,
        )


def new_sequences(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    prompt: str | None,
    arrival_time: float | None,
    num_output_tokens: int,
) -> list[Sequence]:
    """A request's sequences in choice order; the first runs the prompt, the others wait in
    its `forks` until it is computed."""
    first = Sequence(request_id, token_ids, params, prompt, arrival_time, num_output_tokens)
    first.forks = [
        Sequence(request_id, token_ids, params, prompt, first.arrival_time, 0, index=i)
        for i in range(1, params.num_sequences)
    ]
    return [first, *first.forks]


def check_first_tokens(params: SamplingParams, first: FirstTokens) -> None:
    """A prefill worker's first tokens for a request of `params`: `first.token_ids`, and
    `first.logprobs` when given (pass them when best_of > n: they rank the sequences), one per
    sequence (best_of, else n) in the order of that worker's deltas' `index`. ValueError
    otherwise (the caller's bug: a request's own worker returns one per sequence)."""
    k = params.num_sequences
    if len(first.token_ids) != k or (first.logprobs and len(first.logprobs) != k):
        got = len(first.token_ids), len(first.logprobs or ())
        raise ValueError(f"{got[0]} first tokens and {got[1]} log-probabilities for {k} sequences")
