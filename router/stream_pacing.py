"""How often one client stream may be sent a message, given how many streams are open.

Each message the router sends costs its event loop ~50 us whatever it carries, and the gRPC aio
server accepts at most one new call per loop turn. A decode worker steps every few ms for all
of its requests, so sending each stream its tokens as they arrive means hundreds of sends per
turn under load: turns get long, new calls wait seconds to be accepted, and the loop saturates
at ~one token per message. So under load a stream sends at most every
`open streams x PER_STREAM_S` (capped at MAX_INTERVAL_S), and the tokens that arrive meanwhile
go out together. With few streams the interval is well under a decode step: nothing changes.
The first message of a stream is never held back (time to first token is untouched).
"""

from __future__ import annotations

# 256 streams -> 25.6 ms: at most ~10k messages/s in all, half a core of sends.
PER_STREAM_S = 100e-6
MAX_INTERVAL_S = 0.05


class StreamPacer:
    """Counts open streams; `interval()` is the least time between two messages of one."""

    def __init__(self, per_stream_s: float = PER_STREAM_S, max_s: float = MAX_INTERVAL_S) -> None:
        if per_stream_s < 0 or max_s < 0:
            raise ValueError(
                f"per_stream_s and max_s must be >= 0, got {per_stream_s!r}, {max_s!r}."
            )
        self.per_stream_s = per_stream_s
        self.max_s = max_s
        self.open = 0

    def interval(self) -> float:
        return min(self.max_s, self.open * self.per_stream_s)
