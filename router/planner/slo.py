"""SLO attainment as the router measures it: time to first token per request, time between
tokens per token, against the planner's targets, over one planner interval at a time.

`Router.generate` starts a `StreamClock` per request and tells it each chunk's token count:
O(1) work per chunk, no lock (one event loop). A chunk of k tokens after a gap g counts as k
tokens of g / k each (the router sends tokens that piled up together: stream_pacing.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple


class Attainment(NamedTuple):
    ttft: float | None  # share of first tokens within the target (None: no request had one)
    itl: float | None  # share of later tokens within the target (None: none came)


class SloWindow:
    def __init__(self, slo_ttft_s: float, slo_itl_s: float) -> None:
        self.slo_ttft_s = slo_ttft_s
        self.slo_itl_s = slo_itl_s
        self.first = self.first_ok = 0
        self.later = self.later_ok = 0

    def clock(self) -> StreamClock:
        return StreamClock(self)

    def take(self) -> Attainment:
        """The attainment since the last `take`, and a fresh window."""
        ttft = self.first_ok / self.first if self.first else None
        itl = self.later_ok / self.later if self.later else None
        self.first = self.first_ok = self.later = self.later_ok = 0
        return Attainment(ttft, itl)


class StreamClock:
    """One request's stream: when it started and when its last tokens went out."""

    __slots__ = ("_first", "_last", "_window")

    def __init__(self, window: SloWindow) -> None:
        self._window = window
        self._last = time.monotonic()
        self._first = True

    def tokens(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic()
        w, gap = self._window, now - self._last
        self._last = now
        if self._first:
            self._first = False
            w.first += 1
            w.first_ok += gap <= w.slo_ttft_s
            n -= 1  # the chunk's others came with it
            gap = 0.0
        if n:
            w.later += n
            if gap / n <= w.slo_itl_s:
                w.later_ok += n
