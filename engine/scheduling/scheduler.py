"""Continuous batching with chunked prefill, admission by free blocks, preemption by recompute.

The scheduler is the only owner of the KV blocks: it gives them to the sequences it schedules,
to prompts another worker prefills (reservations) and to the decode step launched before the
current one's tokens are read (the lookahead, see engine/scheduling/overlap.py); it frees them when
a sequence ends or is preempted, and publishes full ones to the prefix cache as steps complete.

A request with several choices (n, best_of) is one sequence until its prompt is computed: the
step that completes the prompt forks it (`Sequence.forks`), its choices joining the batch with
no tokens to run and sampling from the prompt's last position. Each forked choice is then a
sequence like any other (preempted alone, recomputed from its prompt and output).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from collections.abc import Sequence as Seq

from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.kv_cache.blocks import Prefix
from pdmesh.engine.outputs import EngineStats, ForkStats
from pdmesh.engine.scheduling.batch import NO_HOST_COPIES, Lookahead, ScheduledBatch
from pdmesh.engine.sequence import Sequence, SequenceStatus
from pdmesh.kv_transfer.connector import ExternalBlocks
from pdmesh.sampling_params import SamplingParams


def _last_token_is_next(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token a step samples for `seq` now is its last, whatever the token."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len


class Scheduler:
    """Each step: first the running sequences (oldest first: one decode token, or the next prompt
    chunk), preempting the newest ones when blocks run out; then, with the token budget left and
    no preemption this step, admit waiting sequences in arrival order while blocks allow.

    Protocol per step: `schedule` (or `schedule_lookahead` while a step is on the device), then
    `complete` once the step is off the device; `finish` when a sequence ends. A prompt prefilled
    elsewhere: `reserve`, then `commit` when its KV is in, or `release` to prefill it here."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        overlap_loads: bool = False,
    ) -> None:
        """overlap_loads: a request admitted with blocks to load from the host tier sits out
        the step that loads them (the loads run beside its forward) when that step has other
        work, and runs from the next; else it runs in that step, after the loads."""
        self._blocks = block_manager
        self.overlap_loads = overlap_loads
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserved: dict[str, Sequence] = {}  # request id -> sequence PREFILLING elsewhere
        self._free_after_step: list[Sequence] = []  # ended while a step still writes their KV
        self.num_preemptions = 0
        self.num_lookaheads = 0  # steps scheduled before the previous one's tokens were read

    # -- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Sequences to schedule (reserved ones are not: they wait for their KV)."""
        return bool(self.waiting or self.running)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def _waiting_demand(self) -> tuple[int, int]:
        """(blocks the waiting sequences that fit now will take, how many wait beyond them): in
        arrival order, up to the first that the free blocks and sequence slots cannot take
        (nobody overtakes it). Prefix-cache hits are not counted: an upper bound on blocks."""
        free = self._blocks.num_free_blocks
        slots = self.max_num_seqs - len(self.running)
        fit = taken = 0
        for seq in self.waiting:
            need = self._blocks.blocks_for(seq.num_tokens) - len(seq.block_table)
            if need > free - taken or slots < seq.num_seqs:
                break
            taken += need
            slots -= seq.num_seqs
            fit += 1
        return taken, len(self.waiting) - fit

    def num_waiting_for_blocks(self) -> int:
        """Waiting sequences that the free blocks and sequence slots cannot take now."""
        return self._waiting_demand()[1]

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Tokens of `token_ids` the prefix cache holds now."""
        probe = Sequence("", list(token_ids), SamplingParams())
        return len(self._blocks.match_prefix(probe)) * self._blocks.block_size

    def finish(self, seq: Sequence, reason: str, in_flight: bool = False) -> None:
        """End `seq` (stop, length or abort), whatever its state. Its full computed blocks join
        the prefix cache (`commit` may have deferred them); its blocks are freed now, or with
        `in_flight` (a step on the device still writes there) by the `complete` of that step."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PREFILLING:
            del self._reserved[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        for choice in seq.forks:  # never forked: they end with it, holding nothing
            choice.status, choice.finish_reason = SequenceStatus.FINISHED, reason
            choice.finished_time = seq.finished_time
        seq.forks = []
        self._blocks.cache_full_blocks(seq)
        if in_flight:
            self._free_after_step.append(seq)
        else:
            self._blocks.free(seq)

    # -- prompts prefilled by another worker ---------------------------------------------------
    def reserve(self, seq: Sequence) -> ExternalBlocks | None:
        """Hold blocks for all of `seq`'s prompt (after the prefix cache's hit) for another worker
        to fill; None, holding nothing, when blocks or sequence slots are short right now."""
        bm = self._blocks
        prefix = self._cached_prefix(seq)
        new_tokens = seq.num_tokens - len(prefix) * bm.block_size
        # No overtaking: the blocks of sequences queued ahead stay theirs, and nothing is held
        # while one of them waits for blocks.
        queued_blocks, beyond = self._waiting_demand()
        if (
            self._seq_slots_taken() + seq.num_seqs > self.max_num_seqs
            or beyond
            or not bm.can_allocate(seq, new_tokens, prefix, queued_blocks)
        ):
            return None
        bm.allocate(seq, new_tokens, prefix)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.PREFILLING
        self._reserved[seq.request_id] = seq
        return ExternalBlocks(len(prefix), seq.block_table[len(prefix) :], new_tokens)

    def hold_free(self, n: int) -> list[int] | None:
        """`n` free blocks for KV written from outside (BlockManager.hold_free), unless that
        would take blocks the waiting sequences need now (None)."""
        queued_blocks, beyond = self._waiting_demand()
        if beyond or self._blocks.num_free_blocks - n < queued_blocks:
            return None
        return self._blocks.hold_free(n)

    @property
    def blocks(self) -> BlockManager:
        return self._blocks

    def take_offloads(self) -> tuple[tuple[int, int], ...]:
        """After `reserve`: the (block, host slot) copies of cached blocks it took, which must
        be run now (a KV receiver, not a step, writes those blocks next)."""
        return self._blocks.take_offloads()

    def _seq_slots_taken(self) -> int:
        return len(self.running) + sum(s.num_seqs for s in self._reserved.values())

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def commit(self, request_id: str, defer_caching: bool = False) -> Sequence:
        """The reserved prompt's KV is in its blocks: the sequence runs from the next step, and
        so do the choices it forks into (`Sequence.forks`). `defer_caching`: its blocks join
        the prefix cache at its next `complete` or `finish`."""
        seq = self._reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_tokens
        if not defer_caching:
            self._blocks.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._fork(seq)
        return seq

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """`seq`'s prompt is computed (or will be by the end of the step being scheduled): its
        pending choices share its blocks and run from now on."""
        forked = [c for c in seq.forks if c.status is SequenceStatus.FORK_PENDING]
        seq.forks = []
        for choice in forked:
            self._blocks.fork(seq, choice)
            choice.num_computed_tokens = seq.num_tokens
            choice.num_cached_tokens = seq.num_cached_tokens
            choice.status = SequenceStatus.RUNNING
            self.running.append(choice)
        return forked

    def release(self, request_id: str) -> Sequence:
        """The remote prefill failed: free the reserved blocks and queue the prompt here."""
        seq = self._reserved.pop(request_id)
        self._blocks.free(seq)
        self.add(seq)
        return seq

    # -- one step -----------------------------------------------------------------------------
    def schedule(
        self, busy: Collection[Sequence] = (), max_seqs: int | None = None
    ) -> ScheduledBatch:
        """The next step. With several steps in flight (pipeline stages): `busy`, the sequences
        of steps not completed yet, are neither scheduled nor preempted, and the step takes at
        most `max_seqs` sequences, so the batches in flight share the running ones."""
        budget = self.max_num_batched_tokens
        limit = max_seqs if max_seqs is not None else self.max_num_seqs
        skip = {id(s) for s in busy}
        bm = self._blocks
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        forks: list[tuple[int, int]] = []

        def take(seq: Sequence, n: int) -> None:
            seqs.append(seq)
            counts.append(n)
            if seq.forks and seq.num_computed_tokens + n >= seq.num_tokens:
                parent = len(seqs) - 1
                for choice in self._fork(seq):
                    skip.add(id(choice))  # in this batch already: not scheduled again
                    forks.append((len(seqs), parent))
                    seqs.append(choice)
                    counts.append(0)

        i = 0
        while i < len(self.running) and budget > 0 and len(seqs) < limit:
            seq = self.running[i]
            if id(seq) in skip:
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            del seq.spec_token_ids[max(0, n - seq.num_uncomputed_tokens) :]  # drafts it runs
            while not bm.can_allocate(seq, n):
                if seq.spec_token_ids:  # draft tokens give way before anyone is preempted
                    seq.spec_token_ids = []
                    n = min(seq.num_uncomputed_tokens, budget)
                    continue
                # The newest admitted gives way (`seq` itself at the latest): not a busy one.
                j = max(k for k in range(i, len(self.running)) if id(self.running[k]) not in skip)
                victim = self.running.pop(j)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n)
                take(seq, n)
                budget -= n
                i += 1

        while self.waiting and budget > 0 and not preempted and len(seqs) < limit:
            seq = self.waiting[0]
            # A request's choices fork within a step of admission: room for all of them (the
            # engine refuses a request with more choices than max_num_seqs).
            if self.running and len(self.running) + seq.num_seqs > self.max_num_seqs:
                break
            prefix = self._cached_prefix(seq)
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
            if self.overlap_loads and seqs and bm.is_loading(seq):
                continue  # its prefix loads beside this step; it runs from the next one
            take(seq, n)
            budget -= n
        copies = tuple(bm.take_copies())
        # An empty batch runs nothing: the host copies wait for the next step that runs.
        host = NO_HOST_COPIES
        if seqs:
            overlap = self.overlap_loads and not any(bm.is_loading(s) for s in seqs)
            host = bm.take_host_copies()._replace(overlap=overlap)
        return ScheduledBatch(seqs, counts, preempted, tuple(forks), copies, host)

    def schedule_lookahead(
        self,
        prev: ScheduledBatch,
        sampled: Seq[int],
        max_model_len: int,
        busy: Collection[Sequence] = (),
    ) -> Lookahead | None:
        """The step after `prev` (on the device, its tokens unread) when it is certain to be one
        decode token for each of `prev`'s continuing sequences, with their KV slots allocated;
        None, allocating nothing, when it is not. `sampled[j]`: the index in `prev.seqs` of the
        sequence whose token is `prev`'s j-th sampled one. `busy`: the sequences of the other
        steps in flight (pipeline stages), which have their turn there."""
        if self.waiting:
            return None
        row_of = {i: j for j, i in enumerate(sampled)}
        rows: list[int] = []
        seqs: list[Sequence] = []
        ending = 0
        for i, seq in enumerate(prev.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # ended (aborted) while `prev` ran: nothing follows
            if i not in row_of:
                return None  # a prompt between chunks: its next chunk needs `schedule`
            if _last_token_is_next(seq, max_model_len):
                ending += 1
                continue
            rows.append(row_of[i])
            seqs.append(seq)
        # Every running sequence is accounted for: none waits for a turn the lookahead would take.
        skip = {id(s) for s in busy}
        elsewhere = sum(1 for s in self.running if id(s) in skip)
        if not seqs or len(seqs) + ending + elsewhere != len(self.running):
            return None
        if len(seqs) > self.max_num_batched_tokens:
            return None
        # `prev` has not been completed yet: each sequence holds slots for num_tokens, and needs
        # one more for the token `prev` samples.
        # A choice forked in `prev` writes a prompt block it shares: copied first (on the
        # device, after `prev` wrote it).
        bm = self._blocks
        ahead = [(s, s.num_tokens + 1 - s.num_computed_tokens) for s in seqs]
        # Most need nothing new (`fits_held`, O(1)): only the others are counted and allocated.
        grow = [(s, n) for s, n in ahead if not bm.fits_held(s, n, write_from=s.num_tokens)]
        need = sum(bm.blocks_needed(s, n, write_from=s.num_tokens) for s, n in grow)
        if need > bm.num_free_blocks:
            return None  # `schedule` decides who gives way
        for seq, n in grow:
            bm.allocate(seq, n, write_from=seq.num_tokens)
        self.num_lookaheads += 1
        copies = tuple(bm.take_copies())
        batch = ScheduledBatch(seqs, [1] * len(seqs), [], (), copies, bm.take_host_copies())
        return Lookahead(batch, rows)

    def complete(self, batch: ScheduledBatch) -> None:
        """The step that ran `batch` is off the device: free the blocks of its sequences finished
        `in_flight` (this step was the one writing them), and count its
        tokens as computed for the others (their blocks that became full join the prefix cache)."""
        ran = {id(s) for s in batch.seqs}
        for seq in self._free_after_step:
            if id(seq) in ran:
                self._blocks.free(seq)
        self._free_after_step = [s for s in self._free_after_step if id(s) not in ran]
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if not seq.is_finished:
                # Draft tokens' KV counts once they are accepted (`accept_drafts`).
                seq.num_computed_tokens += n - len(seq.spec_token_ids)
                self._blocks.cache_full_blocks(seq)

    def accept_drafts(self, seq: Sequence, accepted: int) -> None:
        """After `complete` of a step that ran `seq`'s draft tokens (speculative decoding), once
        the first `accepted` of them are appended to it: their KV counts as computed (full
        blocks join the prefix cache), and the blocks held only for rejected ones are freed."""
        seq.spec_token_ids = []
        if seq.is_finished:  # its blocks are freed already
            return
        seq.num_computed_tokens += accepted
        self._blocks.cache_full_blocks(seq)
        self._blocks.trim(seq)

    def _cached_prefix(self, seq: Sequence) -> Prefix:
        """The prefix cache's blocks for `seq`: none when it asks for its prompt's
        log-probabilities, which every prompt position's logits give (a hit costs a recompute)."""
        if seq.params.prompt_logprobs is not None:
            return Prefix()
        return self._blocks.match_prefix(seq)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute on re-admission: prompt and output so far are prefilled again (mostly from the
        # prefix cache, if its blocks were not reused meanwhile).
        self._blocks.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- state --------------------------------------------------------------------------------
    def fork_stats(self) -> ForkStats:
        bm = self._blocks
        return ForkStats(bm.num_forked_blocks, bm.num_block_copies)

    def stats(self) -> EngineStats:
        bm = self._blocks
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_queried_tokens=bm.prefix_queried_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.num_preemptions,
            steps_launched_ahead=self.num_lookaheads,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by a free block (benchmarks: a cold cache)."""
        self._blocks.reset_prefix_cache()

    def reset_stats(self) -> None:
        """Zero the counters `stats` reports (an engine's warm-up: engine/warm_up.py)."""
        self.num_preemptions = self.num_lookaheads = 0
        self._blocks.reset_counters()
