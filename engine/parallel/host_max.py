"""An element-wise maximum of a few integers over a group's ranks, on the host, through shared
memory when every rank runs on this machine: the data-parallel ranks' agreement before each
step (the most tokens any rank runs, whether every rank's step fits a CUDA graph).

A gloo all-reduce of two integers cost 0.25-0.5 ms of a 2.9 ms decode step of DP=2 + EP=2 on
two H200s (BENCHMARKS.md, issue 30): its sockets, on every step. Here each rank writes its
values, then the round's number, into a slot of a segment every rank maps, and waits until
every slot holds that round. Slots alternate between two banks by the round's parity: a rank
can be at most one round ahead of another (the next round needs every rank's write, which a
rank makes only after reading this one), so it never overwrites values a slower rank still
reads. Stores become visible in program order on x86-64 (TSO), which the value-then-round
protocol needs; elsewhere, across machines, or with PDMESH_DP_AGREEMENT=gloo, the gloo
all-reduce it replaces is used.

Callers may rely on: every rank calls `__call__` the same number of times, in the same order,
with lists of the same length (`width`); each call returns the same list on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdmesh import envs
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.shm import shared_segment, wait_until

_SLOT = 8  # int64 words a slot: the round, then up to 7 values (64 bytes, a cache line)
_KEY = "pdmesh/host-max"


class HostMax:
    """max over the group's ranks of `width` ints a call (`__call__`), through shared memory
    (`shared` True) or the group's gloo host group. Every rank builds it at the same point."""

    def __init__(self, group: ParallelGroup, width: int) -> None:
        if not 1 <= width < _SLOT:
            raise ValueError(f"HostMax takes 1 to {_SLOT - 1} values a call, not {width}")
        self.group, self.width = group, width
        self.round = 0
        # The segment's int64 words (the mapping lives as long as the view); None: gloo.
        segment = shared_segment(group, _KEY, _size(group), envs.dp_agreement() == "auto")
        self.segment = segment.name  # under /dev/shm while the ranks map it, then unlinked
        memory = segment.memory
        self._words = memoryview(memory).cast("q") if memory is not None else None

    @property
    def shared(self) -> bool:
        return self._words is not None

    def __call__(self, values: list[int]) -> list[int]:
        if self._words is None:
            t = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.host_group)
            return t.tolist()
        self.round += 1
        words, r, size = self._words, self.round, self.group.size
        bank = (r % 2) * size * _SLOT
        mine = bank + self.group.rank * _SLOT
        for i, v in enumerate(values):
            words[mine + 1 + i] = v
        words[mine] = r  # after the values: a reader that sees the round sees them
        out = list(values)
        for rank in range(size):
            slot = bank + rank * _SLOT
            wait_until(lambda slot=slot: words[slot] == r, f"data-parallel rank {rank}, round {r}")
            theirs = words[slot + 1 : slot + 1 + self.width].tolist()
            out = [max(a, b) for a, b in zip(out, theirs, strict=True)]
        return out


def _size(group: ParallelGroup) -> int:
    """Bytes of the segment: two banks of a slot per rank."""
    return 2 * group.size * _SLOT * 8
