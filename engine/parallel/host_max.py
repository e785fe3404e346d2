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

import mmap
import os
import platform
import secrets
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pdmesh import envs
from pdmesh.engine.parallel.group import ParallelGroup

_SLOT = 8  # int64 words a slot: the round, then up to 7 values (64 bytes, a cache line)
_SPIN_S = 0.002  # spin (yielding the core) this long, then sleep between looks,
_SLEEP_S = (50e-6, 1e-3)  # from the first to the last, doubling: idle ranks (a mesh worker's
# lockstep waits up to 50 ms for a command before each agreement) wake ~1,000 times a second
_TIMEOUT_S = 7 * 24 * 3600.0  # ranks idle together wait as long as the gloo group's timeout
_KEY = "pdmesh/host-max"
_SHM = Path("/dev/shm")


class HostMax:
    """max over the group's ranks of `width` ints a call (`__call__`), through shared memory
    (`shared` True) or the group's gloo host group. Every rank builds it at the same point."""

    def __init__(self, group: ParallelGroup, width: int) -> None:
        if not 1 <= width < _SLOT:
            raise ValueError(f"HostMax takes 1 to {_SLOT - 1} values a call, not {width}")
        self.group, self.width = group, width
        self.round = 0
        # The segment's int64 words (the mapping lives as long as the view); None: gloo.
        self._words: memoryview | None = None
        name = _shared_segment(group)
        self.segment = name  # under /dev/shm while the ranks map it, then unlinked ("": gloo)
        if name:
            with open(_SHM / name, "r+b") as f:
                self._words = memoryview(mmap.mmap(f.fileno(), _size(group))).cast("q")
        dist.barrier(group=group.host_group)  # every rank has mapped it: the name can go
        if name and group.rank == 0:
            (_SHM / name).unlink(missing_ok=True)

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
        start, nap = time.monotonic(), _SLEEP_S[0]
        for rank in range(size):
            slot = bank + rank * _SLOT
            while words[slot] != r:
                waited = time.monotonic() - start
                if waited > _TIMEOUT_S:
                    raise RuntimeError(f"data-parallel rank {rank} did not reach round {r}")
                if waited < _SPIN_S:
                    os.sched_yield()
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, _SLEEP_S[1])
            theirs = words[slot + 1 : slot + 1 + self.width].tolist()
            out = [max(a, b) for a, b in zip(out, theirs, strict=True)]
        return out


def _size(group: ParallelGroup) -> int:
    """Bytes of the segment: two banks of a slot per rank."""
    return 2 * group.size * _SLOT * 8


def _shared_segment(group: ParallelGroup) -> str:
    """The name under /dev/shm of the segment rank 0 made for the group, or "" where the ranks
    cannot share one (another machine or container among them, not x86-64, no /dev/shm)."""
    store = group.store
    store.set(f"{_KEY}/machine/{group.rank}", _machine())
    if group.rank == 0:
        name = ""
        machines = {store.get(f"{_KEY}/machine/{r}").decode() for r in range(group.size)}
        one = len(machines) == 1 and platform.machine() in ("x86_64", "AMD64")
        if one and _SHM.is_dir() and envs.dp_agreement() == "auto":
            name = f"pdmesh-host-max-{secrets.token_hex(8)}"
            with open(_SHM / name, "wb") as f:
                f.truncate(_size(group))
        store.set(f"{_KEY}/name", name)
    return store.get(f"{_KEY}/name").decode()


def _machine() -> str:
    """This machine and boot, as seen from inside its container: equal on two ranks only where
    they can map one /dev/shm file."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{os.stat(_SHM).st_ino if _SHM.is_dir() else ''}"
