"""Posting KV frames to one receiver, in queue order and in batches: a batch's headers go to the
receiver as one message on the pair's header channel, its payloads follow as one send over the
pair's group (device to device on the GPU). The caller posts on its own thread when it can, a
thread per pair when it cannot. Used by p2p_sender.py."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.frame import HEADER_NBYTES
from pdmesh.kv_transfer.p2p_pairs import BATCH_BYTES, COALESCE_BYTES, MAX_BATCH_FRAMES


@dataclass
class Send:
    """One posted send (a batch of frames); `done` once a waiter saw it complete."""

    work: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False


@dataclass
class Frame:
    """One queued frame, or several frames' headers over one payload (a run of layers gathered
    together); `posted` is set once its send was posted (`sent`) or failed (`error`)."""

    header: bytes  # one or more packed headers
    payload: torch.Tensor  # flat uint8, on the sender's device
    ready: torch.cuda.Event | None  # the payload's copy is done (CUDA); None on the CPU
    # Makes the payload, once the headers are pushed (frames made together share one): the
    # receiver posts its receive while the copy runs. Returns what `ready` would be.
    fill: Callable[[], torch.cuda.Event | None] | None = None
    sent: Send | None = None  # the batch's send, once posted
    error: str | None = None
    posted: threading.Event = field(default_factory=threading.Event)

    @property
    def count(self) -> int:
        """The frames it carries (one per header)."""
        return len(self.header) // HEADER_NBYTES


class Pair:
    """A two-rank group to one receiver, and who posts its frames, in queue order.

    When COALESCE_BYTES or more are queued (a prompt's cached blocks), the caller posts them on
    its own thread, at once, with no hand-over to another thread (waking one costs up to the
    GIL's switch interval). The pair's thread posts the rest: the very first batch (NCCL makes
    the pair's communicator in the first send, which blocks until the receiver joins), and small
    frames (a prefill's layers one at a time). Those go out together, every frame queued by the
    time the thread takes them in one batch: posting costs ~0.4 ms of host on a busy host, and
    the receiver ~0.5 ms a batch, where a layer of a 4,096-token 8B prompt takes 0.05 ms on the
    wire; posting each on the caller's thread made the layer-by-layer benchmark 1.4x slower and
    would hold up the forward pass that pushes them.

    A batch is queued frames up to BATCH_BYTES: one header message carries their headers, one
    send their payloads back to back (straight from their buffer when they already lie so, as
    layers gathered together do; else joined). Batches taken together have all their header
    messages pushed before the first send, so the receiver posts its receives sooner.
    """

    def __init__(self, group: Any, headers: Any, name: str) -> None:
        self.group = group
        self.headers = headers  # the pair's HeaderOutbox (push, close), used while posting only
        self.broken: str | None = None
        self._queue: deque[Frame] = deque()
        self._queued = 0  # payload bytes in the queue
        self._wake = threading.Condition()
        self._closed = False
        self._posting = False  # a thread (the caller's or the pair's) is posting now
        self._warm = False  # a first batch went out (its send made NCCL's communicator)
        self._stream: torch.cuda.Stream | None = None  # made for the first CUDA payload
        threading.Thread(target=self._post_frames, name=name, daemon=True).start()

    def put(self, frames: list[Frame]) -> None:
        """Queue frames together, and post them now on the caller's thread when they are many
        bytes (see the class); else leave them to the pair's thread."""
        with self._wake:
            if self.broken is not None or self._closed:
                raise TransferError(self.broken or "the KV sender is closed")
            self._queue.extend(frames)
            self._queued += sum(f.payload.numel() for f in frames)
            inline = not self._posting and self._warm and self._queued >= COALESCE_BYTES
            if not inline:
                self._wake.notify()
                return
            batches = self._take()
        self._post_batches(batches)

    def close(self, reason: str) -> None:
        with self._wake:
            self._closed = True
            self.broken = self.broken or reason
            self._wake.notify()

    def _take(self) -> list[list[Frame]]:
        """Every queued frame as batches, marked as being posted (the lock held)."""
        self._posting = True
        batches = []
        while self._queue:
            batch = [self._queue.popleft()]
            size = batch[0].payload.numel()
            headers = len(batch[0].header)
            joined = False  # the batch so far lies back to back in one buffer: keep it so
            while self._queue:
                nxt = self._queue[0]
                if (
                    size + nxt.payload.numel() > BATCH_BYTES
                    or headers + len(nxt.header) > MAX_BATCH_FRAMES * HEADER_NBYTES
                ):
                    break
                follows = _follows(batch[-1].payload, nxt.payload)
                if len(batch) == 1:
                    joined = follows
                elif joined and not follows:
                    break
                size += nxt.payload.numel()
                headers += len(nxt.header)
                batch.append(self._queue.popleft())
            batches.append(batch)
        self._queued = 0
        return batches

    def _post_batches(self, batches: list[list[Frame]]) -> None:
        """Post batches taken by `_take`; frames of a failed post fail, and the pair breaks."""
        try:
            self._post(batches)
        except Exception as e:
            with self._wake:
                self.broken = f"{e}"
                self._closed = True
                self._posting = False
                self._wake.notify()
            for batch in batches:
                _fail(batch, self.broken)
            return
        with self._wake:
            self._warm = True
            self._posting = False
            if self._queue:
                self._wake.notify()  # queued meanwhile: the thread takes them

    def _post_frames(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._posting or not self._queue):
                    self._wake.wait()
                if self._closed:
                    gone, self._queue, self._queued = list(self._queue), deque(), 0
                    _fail(gone, self.broken or "the KV sender is closed")
                    break
                batches = self._take()
            self._post_batches(batches)
        self.headers.close()

    def _post(self, batches: list[list[Frame]]) -> None:
        """Every batch's headers pushed, then its payload made (`Frame.fill`) and sent."""
        first = batches[0][0].payload
        if first.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(first.device)
        stream = self._stream if first.is_cuda else None
        for batch in batches:
            self.headers.push(b"".join(f.header for f in batch))
        made: dict[int, torch.cuda.Event | None] = {}
        for batch in batches:
            for frame in batch:
                if frame.fill is not None:  # on this thread's current stream
                    if id(frame.fill) not in made:
                        made[id(frame.fill)] = frame.fill()
                    frame.ready = made[id(frame.fill)]
        with torch.cuda.stream(stream):  # None on the CPU: a no-op
            for batch in batches:
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
                sent = Send(self.group.send([payload], 1, 0))
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
