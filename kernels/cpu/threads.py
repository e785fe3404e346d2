"""How many threads the CPU kernels use: torch's (ATen, oneDNN) and Numba's, set together.

Numba's OpenMP threading layer, when it starts (on its first parallel kernel, the first decode
step's attention, or on any call that sets its count), sets the process's OpenMP thread count to
its own, one per core, and torch's intra-op pool follows: a count set before (PDMESH_NUM_THREADS,
or each rank's share of the cores when several ranks share one CPU) was lost after the first
step, silently. Numba's count is set first here (which starts its pool), then torch's.
"""

from __future__ import annotations

import numba
import torch


def set_cpu_threads(count: int) -> None:
    """Use `count` threads for torch's and Numba's CPU kernels from now on (at least 1)."""
    count = max(1, count)
    # Numba's first call starts its pool, which resets OpenMP's count: it goes first.
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(count)
