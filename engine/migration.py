"""Taking a running request out of an engine with its KV blocks intact (live migration).

A draining decode worker detaches each running request: the engine forgets it (no delta, no
further step) while a holder keeps a reference to each of its blocks, so their KV survives
until another worker has copied it; `drop` then frees them. What the next worker needs to
continue the request is its tokens: replaying them rebuilds every other piece of state (the
detokenizer's held-back text, a grammar's matcher, penalty counts and a seed's position, see
`Request.start`), and the KV of all but the last is in the held blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class Detached:
    """A request taken out of the engine. Its KV covers `token_ids[:-1]` (the last token is the
    next input), in `holder.block_table` (blocks in sequence order)."""

    request_id: str
    token_ids: list[int]  # prompt + output
    num_output_tokens: int
    holder: Sequence  # the blocks' references; give it to `drop`

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids) - 1


def movable(engine: LLMEngine, request_id: str) -> bool:
    """Whether the request can leave with its KV: one sequence on a single-rank engine, running,
    with output so far and the KV of every token but the last computed."""
    request = engine.request(request_id)
    if request is None or len(request.choices) != 1 or engine.config.world_size != 1:
        return False
    seq = request.seq
    return (
        seq.status is SequenceStatus.RUNNING
        and seq.num_output_tokens >= 1
        and seq.num_computed_tokens == seq.num_tokens - 1
    )


def detach(engine: LLMEngine, request_id: str) -> Detached | None:
    """Take a `movable` request out of the engine, its blocks held (None: not movable; nothing
    changed). Engine thread, between steps. A step still on the device for it (async
    scheduling) only writes the KV of the last token, which is not handed over, and its sampled
    token is dropped."""
    if not movable(engine, request_id):
        return None
    request = engine.request(request_id)
    assert request is not None  # movable
    seq = request.seq
    holder = Sequence(request_id, seq.token_ids, seq.params)
    engine.scheduler.blocks.share(seq, holder)
    detached = Detached(request_id, list(seq.token_ids), seq.num_output_tokens, holder)
    engine.abort_request(request_id)  # its delta is not published: the request moves on
    engine.release(request_id)
    return detached


def drop(engine: LLMEngine, detached: Detached) -> None:
    """Free a detached request's blocks (engine thread). Idempotent."""
    if detached.holder.block_table:
        engine.scheduler.blocks.free(detached.holder)
