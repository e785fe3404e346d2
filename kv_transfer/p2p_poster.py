"""Posting KV frames to one receiver, in queue order and in batches: a batch's headers go to the
receiver as one message on the pair's header channel, its payloads follow as one send over the
pair's group (device to device on the GPU). The caller posts on its own thread when it can, a
thread per pair when it cannot. Used by p2p_sender.py."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.p2p_pairs import (
    BATCH_BYTES,
    COALESCE_BYTES,
    HELD_POLL_S,
    MAX_BATCH_FRAMES,
)


@dataclass
class Send:
    """One posted send (a batch of frames); `done` once a waiter saw it complete."""

    work: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False

    def finished(self) -> bool:
        """Known complete, without waiting (a work that cannot tell says False)."""
        if self.done:
            return True
        try:
            return bool(self.work.is_completed())
        except Exception:  # a work without the query, or one that failed: not known done
            return False


@dataclass
class Frame:
    """One queued frame; `posted` is set once its send was posted (`sent`) or failed (`error`)."""

    header: bytes
    payload: torch.Tensor  # flat uint8, on the sender's device
    ready: torch.cuda.Event | None  # the payload's copy is done (CUDA); None on the CPU
    sent: Send | None = None  # the batch's send, once posted
    error: str | None = None
    posted: threading.Event = field(default_factory=threading.Event)


class Pair:
    """A two-rank group to one receiver, and who posts its frames, in queue order.

    The caller posts on its own thread when it can: frames queued while nothing else is being
    posted go out at once (header message, then one send), with no hand-over to another thread
    (waking one costs up to the GIL's switch interval while the caller runs a forward pass). The
    pair's thread posts what the caller could not: the very first batch (NCCL makes the pair's
    communicator in the first send, which blocks until the receiver joins), and small frames
    held back while `window` sends are in flight.

    Holding small frames back is what keeps the receiver's pace: it spends ~0.1 ms of host per
    batch (headers, a recv posted, a write), so frames that take less than that on the wire
    (one layer of a short prompt) would leave it behind if each went alone. Held frames go out
    together, as one send, once a send in flight completes. Nothing is held once COALESCE_BYTES
    are queued. Each batch is every frame queued so far, up to BATCH_BYTES: one header message
    carries their headers, one send their payloads back to back (straight from their buffer
    when they already lie so, as layers gathered together do; else joined).
    """

    def __init__(self, group: Any, headers: Any, name: str, window: int | None = None) -> None:
        self.group = group
        self.headers = headers  # the pair's HeaderOutbox (push, close), used while posting only
        self.broken: str | None = None
        self._queue: deque[Frame] = deque()
        self._queued = 0  # payload bytes in the queue
        self._wake = threading.Condition()
        self._closed = False
        self._posting = False  # a thread (the caller's or the pair's) is posting a batch now
        self._warm = False  # a first batch went out: the caller may post itself
        self._window = window  # sends in flight before small frames are held; None: never held
        self._in_flight: deque[Send] = deque()
        self._stream: torch.cuda.Stream | None = None  # made for the first CUDA payload
        threading.Thread(target=self._post_frames, name=name, daemon=True).start()

    def put(self, frames: list[Frame]) -> None:
        """Queue frames together, and post them now on the caller's thread when nothing holds
        them (see the class)."""
        with self._wake:
            if self.broken is not None or self._closed:
                raise TransferError(self.broken or "the KV sender is closed")
            self._queue.extend(frames)
            self._queued += sum(f.payload.numel() for f in frames)
            batch = self._take() if self._warm else None
            if batch is None:
                self._wake.notify()
                return
        self._post_batch(batch)

    def close(self, reason: str) -> None:
        with self._wake:
            self._closed = True
            self.broken = self.broken or reason
            self._wake.notify()

    def _ready(self) -> bool:
        """Queued frames that may go now (the condition's lock held)."""
        if not self._queue or self._posting:
            return False
        if self._window is None or self._queued >= COALESCE_BYTES:
            return True
        while self._in_flight and self._in_flight[0].finished():
            self._in_flight.popleft()
        return len(self._in_flight) < self._window

    def _take(self) -> list[Frame] | None:
        """The next batch, marked as being posted, if one may go now (the lock held)."""
        if not self._ready():
            return None
        self._posting = True
        batch = [self._queue.popleft()]
        size = batch[0].payload.numel()
        joined = False  # the batch so far lies back to back in one buffer: keep it so
        while (
            self._queue
            and len(batch) < MAX_BATCH_FRAMES
            and size + self._queue[0].payload.numel() <= BATCH_BYTES
        ):
            follows = _follows(batch[-1].payload, self._queue[0].payload)
            if len(batch) == 1:
                joined = follows
            elif joined and not follows:
                break
            size += self._queue[0].payload.numel()
            batch.append(self._queue.popleft())
        self._queued -= size
        return batch

    def _post_batch(self, batch: list[Frame]) -> None:
        """Post one batch taken by `_take`, then whatever may follow it at once."""
        while batch:
            try:
                sent = self._post(batch)
            except Exception as e:
                with self._wake:
                    self.broken = f"{e}"
                    self._closed = True
                    self._posting = False
                    self._wake.notify()
                _fail(batch, self.broken)
                return
            with self._wake:
                self._in_flight.append(sent)
                self._warm = True
                self._posting = False
                batch = self._take()
                if batch is None:
                    self._wake.notify()  # held frames: the thread waits for a send to complete

    def _post_frames(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._ready():
                    # Frames held back wait for a send in flight to complete: look again soon.
                    held = bool(self._queue) and not self._posting
                    self._wake.wait(HELD_POLL_S if held else None)
                if self._closed:
                    gone, self._queue, self._queued = list(self._queue), deque(), 0
                    _fail(gone, self.broken or "the KV sender is closed")
                    break
                batch = self._take()
            if batch is not None:
                self._post_batch(batch)
        self.headers.close()

    def _post(self, batch: list[Frame]) -> Send:
        first = batch[0].payload
        if first.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(first.device)
        stream = self._stream if first.is_cuda else None
        with torch.cuda.stream(stream):  # None on the CPU: a no-op
            waited = None
            for frame in batch:
                if frame.ready is not None and stream is not None and frame.ready is not waited:
                    stream.wait_event(frame.ready)  # the payload's copy, on the caller's stream
                    waited = frame.ready
            payload = _back_to_back(batch)
            if payload is None:
                payload = torch.cat([f.payload for f in batch])
                if stream is not None:  # the parts are freed once the cat, on this stream, ran
                    for frame in batch:
                        frame.payload.record_stream(stream)
            self.headers.push(b"".join(f.header for f in batch))
            work = self.group.send([payload], 1, 0)
        sent = Send(work)
        for frame in batch:
            frame.sent = sent
            frame.payload = payload  # alive until the send is done
            frame.posted.set()
        return sent


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Flat payload `b` starts where `a` ends, in the same buffer."""
    return (
        b.data_ptr() == a.data_ptr() + a.numel()
        and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    )


def _back_to_back(batch: list[Frame]) -> torch.Tensor | None:
    """The batch's payloads as one tensor when they lie back to back in one buffer (layers
    gathered together by `send_layers`, or a single frame); None when they must be joined."""
    first = batch[0].payload
    if len(batch) == 1:
        return first
    if not all(_follows(a.payload, b.payload) for a, b in itertools.pairwise(batch)):
        return None
    return first.as_strided((sum(f.payload.numel() for f in batch),), (1,))


def _fail(frames: list[Frame], reason: str) -> None:
    for frame in frames:
        frame.error = reason
        frame.posted.set()
