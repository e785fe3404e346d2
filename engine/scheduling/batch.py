"""What one step runs, as the scheduler hands it to the model runner: the sequences and how many
of each one's tokens, and the block copies to make first (`ScheduledBatch`); the decode step
launched ahead of one still on the device (`Lookahead`)."""

from __future__ import annotations

from typing import NamedTuple

from pdmesh.engine.kv_cache.host.index import HostCopies
from pdmesh.engine.sequence import Sequence

NO_HOST_COPIES = HostCopies((), ())


class ScheduledBatch(NamedTuple):
    """One step's work: run `num_new_tokens[i]` tokens of `seqs[i]` (from its computed count)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]
    # Choices forked this step: (index in seqs of the choice, index of the sequence whose
    # prompt this step completes). A choice runs no tokens and samples from that one's logits.
    forks: tuple[tuple[int, int], ...] = ()
    # Copy on write: (source, copy) block pairs whose KV every rank copies before the step.
    block_copies: tuple[tuple[int, int], ...] = ()
    # The host tier's copies, which every rank runs before those (engine/kv_cache/host/index.py).
    host_copies: HostCopies = NO_HOST_COPIES

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Lookahead(NamedTuple):
    """The decode step after one still on the device (see `Scheduler.schedule_lookahead`)."""

    batch: ScheduledBatch
    rows: list[int]  # for each of batch.seqs: the row of the previous step's sampled tokens
