"""Handling a step that verified draft tokens (speculative decoding): each sampled sequence
outputs its accepted drafts and one more token; the slots of rejected drafts are rolled back.

The order matters for the paged cache: `Scheduler.complete` counts the step's real tokens as
computed (not its drafts), the tokens output are appended one by one (each may end the request:
EOS, stop ids and strings, max_tokens), then `Scheduler.accept_drafts` counts the KV of the
drafts appended as computed, publishes blocks that became full (their hashes over accepted
tokens only) and frees the blocks held only for rejected drafts. A sequence that ended meanwhile
has freed all of its blocks already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdmesh.engine.outputs import PositionLogprobs, StepDelta, mark_request_ends
from pdmesh.engine.spec_decode.verify import Verify

if TYPE_CHECKING:
    from pdmesh.engine.scheduling.overlap import InFlight
    from pdmesh.engine.step_loop import StepLoop


def verified_step(loop: StepLoop, cur: InFlight) -> list[StepDelta]:
    """The deltas of `cur`, a step whose handle verifies drafts (`handle.verify`): one per
    sampled sequence, with every token it output this step."""
    handle, batch = cur.handle, cur.batch
    verify: Verify = handle.verify
    tokens = handle.read()  # [R]: a token per logits row
    emitted = verify.accept(tokens)
    entries: list[list[PositionLogprobs | None]] | None = None
    if handle.logprobs is not None:
        top, wanted = handle.logprobs
        entries = verify.logprobs(top, wanted, tokens, emitted)
    loop.record_prompt_logprobs(cur)
    loop.scheduler.complete(batch)
    speculator = loop.speculator
    assert speculator is not None
    deltas: list[StepDelta] = []
    for j, i in enumerate(handle.sample_seq_index):
        seq, drafts = batch.seqs[i], verify.drafts[j]
        out: list[StepDelta] = []
        if not seq.is_finished:  # else aborted while the step ran
            request = loop.request(seq.request_id)
            assert request is not None  # a running sequence's request is known
            for t, token in enumerate(emitted[j]):
                lp = entries[j][t] if entries is not None else None
                out.append(loop.append_token(request, seq, token, lp))
                if seq.is_finished:
                    break
        accepted = min(len(out), len(emitted[j]) - 1)  # drafts among the tokens appended
        loop.scheduler.accept_drafts(seq, accepted)
        if drafts:
            speculator.record(len(drafts), accepted)
        if out:
            deltas.append(_merged(out))
    speculator.stats.verify_steps += 1
    return mark_request_ends(deltas, loop.is_finished)


def _merged(deltas: list[StepDelta]) -> StepDelta:
    """One choice's deltas of a step as one (tokens, text and log-probabilities in order; the
    last one's finish reason)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    logprobs = None
    if first.logprobs is not None:
        logprobs = [p for d in deltas for p in d.logprobs or ()]
    return first._replace(
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        logprobs=logprobs,
    )
