"""The last program to arrive finishes the work: a counter per group of programs, so that a
kernel whose programs each write a partial result can also combine them, with no second kernel.

A group's programs write their partials, then take a ticket from the group's counter
(`last_to_arrive`); the one that draws the last ticket sees every partial (the counter's atomic
orders the writes before it), combines them and sets the counter back to zero for the next
launch. A second kernel would cost a launch and, at decode batch sizes, more than the work.

Callers may rely on: counters from `arrival_counters` are zero between launches (each launch's
last program resets the ones it used), and a device's counters stay allocated for the process's
life, so CUDA graphs captured with them stay valid. Launches that use them must be ordered on
one stream per device (two kernels taking tickets from the same counters at once would mix
their groups), as every launch in pdmesh is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Counters allocated at once on a device (int32: 16 KiB): a decode step's sequences x KV heads.
MIN_COUNTERS = 4096

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown counters a captured graph may still use


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least `n` zeroed int32 counters on `device`, or None while a CUDA graph is being
    captured and none that large exist yet (a capture records a memset, it does not run one, so
    counters allocated then would not be zero at the first launch)."""
    have = _counters.get(device)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if have is not None:
        _retired.append(have)
    have = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    _counters[device] = have
    return have


@triton.jit
def last_to_arrive(counter_ptr, arrivals):
    """Whether this program is the last of `arrivals` programs to take a ticket from the counter
    at `counter_ptr` (then the counter is reset to zero, and every other program's writes before
    its ticket are visible to it: read them with cache_modifier=".cg", past the SM's L1)."""
    tl.debug_barrier()  # this program's threads have all written their part
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
