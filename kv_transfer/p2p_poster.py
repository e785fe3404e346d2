"""The thread per (sender, receiver) pair that posts KV frames, in queue order and in batches:
a batch's headers go to the receiver as one message on the pair's header channel, its payloads
follow as one send over the pair's group (device to device on the GPU). Used by p2p_sender.py."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.p2p_pairs import BATCH_BYTES, MAX_BATCH_FRAMES


@dataclass
class Send:
    """One posted send (a batch of frames); `done` once a waiter saw it complete."""

    work: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False


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
    """A two-rank group to one receiver and the thread that posts its frames, in queue order.

    The thread takes every frame queued so far (up to BATCH_BYTES) as one batch: one header
    message carries the batch's headers, one send its payloads back to back (straight from their
    buffer when they already lie so, as layers gathered together do; else joined). The receiver then
    takes one header message and posts one recv per batch, not per layer, when a whole prompt's KV
    is ready at once (a prefix-cache hit, a benchmark); during a prefill, layers come one at a time.
    """

    def __init__(self, group: Any, headers: Any, name: str) -> None:
        self.group = group
        self.headers = headers  # the pair's HeaderOutbox (push, close), used by its thread only
        self.broken: str | None = None
        self._queue: deque[Frame] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._stream: torch.cuda.Stream | None = None  # made for the first CUDA payload
        threading.Thread(target=self._post_frames, name=name, daemon=True).start()

    def put(self, frames: list[Frame]) -> None:
        """Queue frames together (the thread sees all of them at once)."""
        with self._wake:
            if self.broken is not None or self._closed:
                raise TransferError(self.broken or "the KV sender is closed")
            self._queue.extend(frames)
            self._wake.notify()

    def close(self, reason: str) -> None:
        with self._wake:
            self._closed = True
            self.broken = self.broken or reason
            self._wake.notify()

    def _next_batch(self) -> list[Frame] | None:
        with self._wake:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                gone, self._queue = list(self._queue), deque()
                _fail(gone, self.broken or "the KV sender is closed")
                return None
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
            return batch

    def _post_frames(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._post(batch)
            except Exception as e:
                with self._wake:
                    self.broken = f"{e}"
                    self._closed = True
                _fail(batch, self.broken)
        self.headers.close()

    def _post(self, batch: list[Frame]) -> None:
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
