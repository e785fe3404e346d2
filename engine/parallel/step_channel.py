"""Rank 0's step messages to its followers on one machine, through shared memory.

A gloo broadcast is a rendezvous of the ranks' host threads over loopback TCP: rank 0 returns
once its followers have taken the message, and a follower that has just launched a step learns
of the next only when its thread gets the bytes. Profiled on two H200s (EP=2, batch 1), rank 0
spent 0.6 ms of a step's host time in gloo broadcasts, and its follower launched each step's
graph 0.6 ms after rank 0 (BENCHMARKS.md, issues 30 and 34). Here rank 0 writes each message
into the next slot of a ring every rank maps and goes on; a follower waits for the slot's
number, copies the message out and acknowledges it in a line of its own. Rank 0 reuses a slot
only once every follower has acknowledged the message it held, so it runs at most SLOTS
messages ahead of the slowest follower. The message then its number, the copy then the
acknowledgement: in program order on x86-64 (TSO), which is all the protocol needs.

Where the ranks cannot share a segment (several machines, not x86-64), with
PDMESH_STEP_CHANNEL=gloo, or on CPUs unless PDMESH_STEP_CHANNEL=shm (a waiting follower spins on
a core that a CPU engine's ranks compute on), messages go over the group's gloo broadcast.

Callers may rely on: every rank calls `broadcast` the same number of times, in the same order,
with messages of `words` int64s, and each call returns rank 0's message; only one thread of rank
0 sends at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdmesh import envs
from pdmesh.engine.parallel.comm import broadcast_host
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.shm import shared_segment, wait_until

SLOTS = 8
_LINE = 8  # int64 words of a cache line: each follower's acknowledgement has one to itself
_KEY = "pdmesh/step-channel"


class StepChannel:
    """Broadcasts of `words` int64s from rank 0 to every rank of `group` (`broadcast`). Every rank
    builds it at the same point, after the group."""

    def __init__(self, group: ParallelGroup, words: int) -> None:
        self.group, self.words = group, words
        self.count = 0  # messages so far
        # Rank 0: raises when a follower has died (the driver's process monitoring sets it), so
        # a full ring does not wait on a rank that will never acknowledge.
        self.check_followers: Callable[[], object] | None = None
        mode = envs.step_channel()
        wanted = mode == "shm" or (mode == "auto" and group.device.type == "cuda")
        # Layout (int64 words): a line per rank (the followers' acknowledgements), then SLOTS
        # slots of a line (the message's number) and the message.
        self._slot_words = _LINE + words
        size = 8 * (group.size * _LINE + SLOTS * self._slot_words)
        segment = shared_segment(group, _KEY, size, wanted)
        # Views of the mapping (which lives as long as they do): words to poll, a tensor to copy.
        self._words: memoryview | None = None
        self._tensor: torch.Tensor | None = None
        if segment.memory is not None:
            self._words = memoryview(segment.memory).cast("q")
            self._tensor = torch.frombuffer(segment.memory, dtype=torch.int64)

    def _rank0_alive(self) -> None:
        self.group.store.check([f"{_KEY}/name"])  # a round trip to rank 0's store; raises if gone

    @property
    def shared(self) -> bool:
        return self._words is not None

    def broadcast(self, message: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's `message` ([words] int64 on the CPU; None on the other ranks), on every rank."""
        if self._words is None or self._tensor is None:
            return broadcast_host(message, self.words, torch.int64, self.group)
        self.count += 1
        n, words, size = self.count, self._words, self.group.size
        slot = size * _LINE + (n % SLOTS) * self._slot_words
        data = slice(slot + _LINE, slot + _LINE + self.words)
        if self.group.rank == 0:
            if message is None or message.numel() != self.words:
                raise ValueError(f"rank 0 broadcasts messages of {self.words} int64s")
            # The slot's last message, n - SLOTS, acknowledged by every follower.
            for rank in range(1, size):
                acked = lambda r=rank: words[r * _LINE] >= n - SLOTS  # noqa: E731
                wait_until(acked, f"rank {rank}'s step", self.check_followers)
            self._tensor[data].copy_(message)
            words[slot] = n  # after the message: a rank that sees the number sees it
            return message
        # Rank 0 gone (its store with it): raised here, as a gloo broadcast would have.
        wait_until(lambda: words[slot] == n, f"rank 0's message {n}", self._rank0_alive)
        out = self._tensor[data].clone()
        words[self.group.rank * _LINE] = n  # after the copy: the slot may be written again
        return out
