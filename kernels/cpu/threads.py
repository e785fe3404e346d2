"""How many threads the CPU kernels use: torch's (ATen, oneDNN) and Numba's, set together.

Numba's OpenMP threading layer, when it starts (on its first parallel kernel: the first decode
step's attention), sets the process's OpenMP thread count to its own, one per core, and torch's
intra-op pool follows: a count set before (PDMESH_NUM_THREADS, or each rank's share of the cores
when several ranks share one CPU) was lost after the first step, silently. Numba's pool is
started first here, then both counts are set.
"""

from __future__ import annotations

import torch


def set_cpu_threads(count: int) -> None:
    """Use `count` threads for torch's and Numba's CPU kernels from now on (at least 1)."""
    count = max(1, count)
    try:
        import numba
        from numba.np.ufunc import parallel
    except ImportError:  # no Numba: torch's count is the only one
        torch.set_num_threads(count)
        return
    parallel._launch_threads()  # its start resets OpenMP's count: let that happen first
    torch.set_num_threads(count)
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
