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
    """Counts open streams (`open`); `interval()` is the least time between two messages of one."""

    def __init__(self) -> None:
        self.open = 0

    def interval(self) -> float:
        return min(MAX_INTERVAL_S, self.open * PER_STREAM_S)
