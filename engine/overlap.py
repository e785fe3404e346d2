"""Overlapping the host's work with the device's: the next decode step is launched before the
current one's tokens are read.

A decode step's device time is a few milliseconds; the host around it (reading the sampled
tokens, detokenizing, stop checks, scheduling and building the next step's inputs) is a few
hundred microseconds more that the device sits idle for. When the step after `cur` can only be
"every sequence of `cur` decodes one more token", it is launched while `cur` still runs, with
`cur`'s sampled tokens fed to it on the device; the host then reads and handles `cur`'s tokens
while the device computes the next step (vLLM's async scheduling, SGLang's overlap scheduler).

What is certain before `cur`'s tokens are known decides it: no request waits to be admitted,
every running sequence samples in `cur` (no prompt is mid-way through its chunks), none of them
ends by length (max_tokens, max_model_len), and the KV cache has a slot for each. A sequence
that ends on a token only `cur` reveals (EOS, a stop id or string) or is aborted meanwhile has
its row of the next step dropped; its blocks stay held until that step is off the device (a KV
receiver could otherwise write into a reused block while the step still writes there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdmesh.engine.block_manager import BlockManager
from pdmesh.engine.distributed import host_to_device
from pdmesh.engine.model_runner import StepHandle
from pdmesh.engine.scheduler import ScheduledBatch, Scheduler
from pdmesh.engine.sequence import Sequence, SequenceStatus


@dataclass
class InFlight:
    """A step on the device whose tokens the host has not handled yet."""

    batch: ScheduledBatch
    handle: StepHandle
    _ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self._ids = frozenset(id(s) for s in self.batch.seqs)

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self._ids


def ends_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token a step samples for `seq` now is its last, whatever the token."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len


def next_decode(
    cur: InFlight, scheduler: Scheduler, blocks: BlockManager, max_model_len: int
) -> tuple[ScheduledBatch, torch.Tensor] | None:
    """The step after `cur` when it is certain to be one decode token for each of `cur`'s
    continuing sequences, with their KV slots allocated; and which of `cur`'s sampled tokens
    (on the device, in its order) are its inputs. None when it is not certain."""
    if scheduler.waiting or cur.handle.tokens is None:
        return None
    sampled = {i: j for j, i in enumerate(cur.handle.sample_seq_index)}
    rows: list[int] = []
    seqs: list[Sequence] = []
    ending = 0
    for i, seq in enumerate(cur.batch.seqs):
        if seq.status is not SequenceStatus.RUNNING:
            continue  # ended (aborted) while `cur` ran: nothing follows
        if i not in sampled:
            return None  # a prompt between chunks: its next chunk needs the scheduler
        if ends_by_length(seq, max_model_len):
            ending += 1
            continue
        rows.append(sampled[i])
        seqs.append(seq)
    # Every running sequence is accounted for: none waits for a turn the lookahead would take.
    if not seqs or len(seqs) + ending != scheduler.num_running:
        return None
    if len(seqs) > scheduler.max_num_batched_tokens:
        return None
    # `cur` has not been counted yet: each sequence holds slots for num_tokens, and needs one
    # more for the token `cur` samples.
    need = sum(blocks.blocks_for(s.num_tokens + 1) - len(s.block_table) for s in seqs)
    if need > blocks.num_free_blocks:
        return None  # the scheduler decides who gives way
    for seq in seqs:
        blocks.allocate(seq, seq.num_tokens + 1 - seq.num_computed_tokens)
    tokens = cur.handle.tokens
    if rows != list(range(tokens.numel())):
        # Pinned and non-blocking: a plain copy of the index would wait for `cur` to finish.
        tokens = tokens.index_select(0, host_to_device(torch.tensor(rows), tokens.device))
    return ScheduledBatch(seqs, [1] * len(seqs), []), tokens
