"""Continuous batching with chunked prefill, admission by free blocks, preemption by recompute."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pdmesh.engine.block_manager import BlockManager
from pdmesh.engine.sequence import Sequence, SequenceStatus


class ScheduledBatch(NamedTuple):
    """One step's work: run `num_new_tokens[i]` tokens of `seqs[i]` (from its computed count)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Each step: first the running sequences (oldest first: one decode token, or the next prompt
    chunk), preempting the newest ones when blocks run out; then, with the token budget left and
    no preemption this step, admit waiting sequences in arrival order while blocks allow."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in its blocks (prefilled elsewhere)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def waiting_demand(self) -> tuple[int, int]:
        """(blocks the waiting sequences that fit now will take, how many wait beyond them): in
        arrival order, up to the first that the free blocks and sequence slots cannot take
        (nobody overtakes it). Prefix-cache hits are not counted: an upper bound on blocks."""
        free = self.block_manager.num_free_blocks
        slots = self.max_num_seqs - len(self.running)
        fit = taken = 0
        for seq in self.waiting:
            need = self.block_manager.blocks_for(seq.num_tokens) - len(seq.block_table)
            if need > free - taken or slots <= 0:
                break
            taken += need
            slots -= 1
            fit += 1
        return taken, len(self.waiting) - fit

    def num_waiting_for_blocks(self) -> int:
        """Waiting sequences that the free blocks and sequence slots cannot take now."""
        return self.waiting_demand()[1]

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """End `seq` (stop, length or abort), whatever its state, and free its blocks unless
        the caller frees them later (`free_blocks=False`: a step on the device still writes
        there)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if free_blocks:
            self.block_manager.free(seq)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()  # the newest admitted gives way
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                i += 1

        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            prefix = bm.match_prefix(seq)
            cached = len(prefix) * bm.block_size
            n = min(seq.num_tokens - cached, budget)
            if not bm.can_allocate(seq, n, prefix):
                break  # arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            bm.allocate(seq, n, prefix)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, preempted)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute on re-admission: prompt and output so far are prefilled again (mostly from the
        # prefix cache, if its blocks were not reused meanwhile).
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
