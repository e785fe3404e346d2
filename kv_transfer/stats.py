"""What transfers report: one transfer's figures and a receiver's or sender's counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class TransferStats:
    """One finished transfer. `seconds` runs from its first frame to its last (receiver: written;
    sender: acknowledged), so bytes / seconds is the rate it moved at, not how long it waited."""

    bytes: int  # payload bytes of accepted frames
    seconds: float
    frames: int


@dataclass(frozen=True)
class ReceiverStats:
    """Counters since the receiver started; a snapshot."""

    transfers_completed: int
    transfers_failed: int  # timed out, cancelled, or open when the receiver closed
    bytes_received: int  # payload bytes of accepted frames
    frames_received: int  # accepted frames
    dropped_unknown_transfer: int
    dropped_bad_token: int
    dropped_bad_size: int
    dropped_malformed: int
    seconds_receiving: float  # sum of TransferStats.seconds of completed transfers

    @property
    def frames_dropped(self) -> int:
        return (
            self.dropped_unknown_transfer
            + self.dropped_bad_token
            + self.dropped_bad_size
            + self.dropped_malformed
        )


@dataclass
class SenderStats:
    """Counters since the sender started. A sender counts into its own under its lock and hands
    out copies (`KVSender.stats`)."""

    bytes_sent: int = 0  # payload bytes handed to the transport
    frames_sent: int = 0
    seconds_sending: float = 0.0  # sum of TransferStats.seconds of completed transfers
    transfers: int = 0  # completed (every frame acknowledged)
    transfers_failed: int = 0


S = TypeVar("S", ReceiverStats, SenderStats)


def total_stats(kind: type[S], parts: Iterable[S]) -> S:
    """Counters of several receivers (or senders) added up: a worker's over its transports."""
    parts = list(parts)
    names = [f.name for f in dataclasses.fields(kind)]
    return kind(**{name: sum(getattr(p, name) for p in parts) for name in names})
