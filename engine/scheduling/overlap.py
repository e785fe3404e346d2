"""Overlapping the host's work with the device's: the next decode step is launched before the
current one's tokens are read.

A decode step's device time is a few milliseconds; the host around it (reading the sampled
tokens, detokenizing, stop checks, scheduling and building the next step's inputs) is a few
hundred microseconds more that the device sits idle for. When the step after `cur` can only be
"every sequence of `cur` decodes one more token", it is launched while `cur` still runs, with
`cur`'s sampled tokens fed to it on the device; the host then reads and handles `cur`'s tokens
while the device computes the next step (vLLM's async scheduling, SGLang's overlap scheduler).

What is certain before `cur`'s tokens are known decides it (`Scheduler.schedule_lookahead`,
as the blocks are the scheduler's): no request waits to be admitted, every running sequence
samples in `cur` (no prompt is mid-way through its chunks), none of them ends by length
(max_tokens, max_model_len), and the KV cache has a slot for each. A sequence that ends on a
token only `cur` reveals (EOS, a stop id or string) or is aborted meanwhile has its row of the
next step dropped; its blocks stay held until that step is off the device (a KV receiver could
otherwise write into a reused block while the step still writes there): the engine finishes it
`in_flight`, and the scheduler frees them at that step's `complete`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pdmesh.engine.parallel.comm import host_to_device
from pdmesh.engine.runner.step_handle import StepHandle
from pdmesh.engine.sample import penalties, structured
from pdmesh.engine.scheduling.batch import ScheduledBatch
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence


@dataclass
class InFlight:
    """A step on the device whose tokens the host has not handled yet."""

    batch: ScheduledBatch
    handle: StepHandle
    started: float  # time.perf_counter() when the engine began launching it
    _ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self._ids = frozenset(id(s) for s in self.batch.seqs)

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self._ids


def next_decode(
    cur: InFlight, scheduler: Scheduler, max_model_len: int, others: Iterable[InFlight] = ()
) -> tuple[ScheduledBatch, torch.Tensor] | None:
    """The step after `cur` when the scheduler is certain it is one decode token for each of
    `cur`'s continuing sequences (`Scheduler.schedule_lookahead`, which allocates their slots),
    and which of `cur`'s sampled tokens (on the device, in its order) are its inputs. `others`:
    the other steps in flight (pipeline stages: a batch each), whose sequences are not `cur`'s
    to take."""
    seqs = cur.batch.seqs
    if cur.handle.tokens is None or penalties.shapes_logits(seqs) or structured.constrained(seqs):
        return None  # penalties and grammars read every token before the step
    busy = [seq for other in others for seq in other.batch.seqs]
    ahead = scheduler.schedule_lookahead(
        cur.batch, cur.handle.sample_seq_index, max_model_len, busy
    )
    if ahead is None:
        return None
    tokens = cur.handle.tokens  # [S] int64: `cur`'s sampled tokens
    if ahead.rows != list(range(tokens.numel())):
        # Pinned and non-blocking: a plain copy of the index would wait for `cur` to finish.
        tokens = tokens.index_select(0, host_to_device(torch.tensor(ahead.rows), tokens.device))
    return ahead.batch, tokens  # tokens: [len(batch.seqs)], the next step's input ids
