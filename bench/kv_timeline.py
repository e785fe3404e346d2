"""Timestamps of a KV transfer's steps, for `kv_transfer_gpu --timeline`.

Both processes wrap the transport's methods so that each step stamps the host's monotonic clock
(one clock for every process on the host): the sender's calls, its pair thread taking and
posting each batch, the group's send / recv / wait, the receiver's pair thread getting headers,
posting receives and writing. `timeline` merges one transfer's stamps from both sides.
"""

from __future__ import annotations

import time
from typing import Any

STAMPS: list[tuple[float, str]] = []


def _timed(fn: Any, label: str, enter: bool = True) -> Any:
    """`fn`, stamping `label` when called (if `enter`) and when it returns."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if enter:
            STAMPS.append((time.monotonic(), f"{label}>"))
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((time.monotonic(), f"{label}<"))

    return call


def stamped(owner: Any, name: str, label: str, enter: bool = True) -> None:
    """Wrap `owner.name` so that each call stamps `label` when entered (if `enter`) and when
    it returns."""
    setattr(owner, name, _timed(getattr(owner, name), label, enter))


class Stamped:
    """A proxy stamping calls of the named methods of `inner` (a process group, a
    work), the works they return stamped too."""

    def __init__(self, inner: Any, label: str, methods: tuple[str, ...]) -> None:
        self._inner, self._label, self._methods = inner, label, methods

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr
        label = f"{self._label}.{name}"
        call = _timed(attr, label)
        if name not in ("send", "recv"):
            return call
        return lambda *a, **k: Stamped(call(*a, **k), label, ("wait",))


def stamp_pairs(module: Any) -> None:
    """Stamp the group calls a pair makes in `module` (p2p_sender / p2p_receiver)."""
    group = module.pair_group
    module.pair_group = lambda *a, **k: Stamped(group(*a, **k), "group", ("send", "recv"))


def stamp_sender() -> None:
    from pdmesh.kv_transfer import p2p_pairs, p2p_poster, p2p_sender

    stamped(p2p_sender.P2PSender, "send_blocks", "send_blocks")
    stamped(p2p_sender.P2PSender, "send_layers", "send_layers")
    stamped(p2p_sender.P2PSender, "finish", "finish")
    stamped(p2p_poster.Pair, "_take", "batch taken", enter=False)
    stamped(p2p_poster.Pair, "_post", "post")
    stamped(p2p_pairs.HeaderOutbox, "push", "headers pushed", enter=False)
    stamp_pairs(p2p_sender)


def stamp_receiver() -> None:
    from pdmesh.kv_transfer import inbox, p2p_pairs, p2p_receiver

    stamped(p2p_receiver.P2PReceiver, "_post_batch", "post batch")
    stamped(p2p_receiver.P2PReceiver, "_write_batch", "write")
    stamped(inbox.TransferInbox, "deliver", "deliver", enter=False)
    stamp_pairs(p2p_receiver)
    take = p2p_pairs.HeaderInbox.next

    def next_headers(self: Any, timeout_ms: int) -> bytes | None:
        raw = take(self, timeout_ms)
        if raw is not None:
            STAMPS.append((time.monotonic(), "headers in"))
        return raw

    p2p_pairs.HeaderInbox.next = next_headers  # type: ignore[method-assign]


def drain_stamps() -> list[tuple[float, str]]:
    out = list(STAMPS)
    STAMPS.clear()
    return out


def timeline(timed: list[dict[str, Any]]) -> list[str]:
    """The median transfer's stamps from both processes, in order, in ms from its start."""
    r = sorted(timed, key=lambda r: r["done_at"] - r["started_at"])[len(timed) // 2]
    stamps = sorted([*r["tx_stamps"], *r["rx_stamps"]])
    return [f"{(t - r['started_at']) * 1e3:8.3f} {what}" for t, what in stamps]
