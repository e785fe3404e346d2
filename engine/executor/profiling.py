"""torch.profiler on every rank of a parallel worker, started and stopped between steps.

Rank 0 profiles itself in-process; a follower is told with the control message `ProfileRank`
(`TPDriver.call`), so that a step's timeline can be read on each rank: what its GPU computes,
how long it sends and receives, how long it idles (bench/step_timeline.py reads the traces).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from pdmesh.kv_transfer.connector import control_message


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named span in a profile's host timeline while a profiler runs (`name`: "where.what");
    free otherwise (a `record_function` costs a few microseconds even with no profiler)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@control_message
class ProfileRank:
    """Starts torch.profiler on a follower (`trace` empty), or stops it and writes its Chrome
    trace to `trace` with `.rank{N}.json` appended. The follower replies None."""

    trace: str = ""
    host: bool = False  # on a GPU, the host's operators too


class RankProfiler:
    """One rank's profiler: `start`, then `stop(path)` writes the Chrome trace (CPU and CUDA
    activity) to `path`."""

    def __init__(self) -> None:
        self._prof: Any = None
        # Stopped profiles are kept: freeing one by garbage collection crashed the process once
        # another had run (a segfault in the GC, torch 2.13 on CPU).
        self._done: list[Any] = []

    def start(self, host: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile

        # On a GPU its kernels and the CUDA runtime calls (syncs among them) are the timeline;
        # host operators only when asked: recording them while the step-outbox thread ran
        # collectives crashed a later garbage collection (torch 2.13, CPU, pipeline stages).
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CUDA] if cuda else []
        if host or not cuda:
            activities.append(ProfilerActivity.CPU)
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self, path: str) -> None:
        if self._prof is None:
            raise RuntimeError("this rank's profiler was not started")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._done.append(prof)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(path)

    def handle(self, message: ProfileRank, rank: int) -> None:
        if message.trace:
            self.stop(f"{message.trace}.rank{rank}.json")
        else:
            self.start(message.host)
