"""Segments under /dev/shm that every rank of a group maps, and waiting on words in them.

Used where a gloo collective's sockets cost more than the message: the data-parallel ranks'
agreement before each step (host_max.py) and rank 0's step messages to its followers
(step_channel.py). Rank 0 makes the segment when every rank runs on this machine (one boot, one
/dev/shm) and it is x86-64, whose stores become visible in program order (TSO): the protocols
built on these segments write a message, then a number saying it is complete.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from pdmesh.engine.parallel.group import ParallelGroup

SHM = Path("/dev/shm")
SPIN_S = 0.005  # spin (yielding the core) this long, then sleep between looks,
SLEEP_S = (50e-6, 1e-3)  # from the first to the last, doubling: idle ranks wake ~1,000 times a s
TIMEOUT_S = 7 * 24 * 3600.0  # ranks idle together wait as long as the gloo groups' timeout
PROBE_S = 1.0  # a waiting rank checks this often that the rank it waits for still runs


class Segment(NamedTuple):
    name: str  # its file under /dev/shm, unlinked once every rank mapped it ("": none made)
    memory: mmap.mmap | None  # the mapping; None where the ranks cannot share a segment


def shared_segment(group: ParallelGroup, key: str, size: int, wanted: bool) -> Segment:
    """Every rank of `group` calls this at the same point: the segment of `size` bytes rank 0
    made for `key` (where the ranks can share one and `wanted` holds on rank 0), mapped."""
    store = group.store
    store.set(f"{key}/machine/{group.rank}", _machine())
    if group.rank == 0:
        name = ""
        machines = {store.get(f"{key}/machine/{r}").decode() for r in range(group.size)}
        one = len(machines) == 1 and platform.machine() in ("x86_64", "AMD64")
        if one and SHM.is_dir() and wanted:
            name = f"pdmesh-{key.rsplit('/', 1)[-1]}-{secrets.token_hex(8)}"
            with open(SHM / name, "wb") as f:
                f.truncate(size)
        store.set(f"{key}/name", name)
    name = store.get(f"{key}/name").decode()
    mapped = None
    if name:
        with open(SHM / name, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), size)
    dist.barrier(group=group.host_group)  # every rank has mapped it: the name can go
    if name and group.rank == 0:
        (SHM / name).unlink(missing_ok=True)
    return Segment(name, mapped)


def wait_until(
    ready: Callable[[], bool], what: str, alive: Callable[[], object] | None = None
) -> None:
    """Until `ready()`: spinning (yielding the core) for SPIN_S, then sleeping in doubling naps;
    RuntimeError naming `what` after TIMEOUT_S. `alive`, called about once a second of waiting,
    raises when the rank being waited for is gone (a gloo peer's socket would have closed)."""
    if ready():
        return
    start, nap = time.monotonic(), SLEEP_S[0]
    probed = start
    while not ready():
        now = time.monotonic()
        waited = now - start
        if waited > TIMEOUT_S:
            raise RuntimeError(f"waited {waited:.0f} s for {what}")
        if alive is not None and now - probed > PROBE_S:
            alive()
            probed = now
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(nap)
            nap = min(2 * nap, SLEEP_S[1])


def _machine() -> str:
    """This machine and boot, as seen from inside its container: equal on two ranks only where
    they can map one /dev/shm file."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{os.stat(SHM).st_ino if SHM.is_dir() else ''}"
