"""The tcp transport's sender: a DEALER socket per receiver endpoint and one I/O thread.

Callers stage frames (a copy into CPU buffers) and queue commands; the I/O thread owns every socket
and every handle's progress: it writes frames zero-copy (`copy=False`) as sockets accept them,
reads acks, and settles each handle's future when all its frames are acknowledged or one is
refused. Sockets connect with IMMEDIATE, so nothing is queued towards a receiver that is not
there: frames wait in the outbox and `finish` fails at its timeout instead of hanging.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import zmq

from pdmesh.kv_transfer.base import KVSender, SendHandle, TransferError
from pdmesh.kv_transfer.frame import MAX_FRAME_PAYLOAD, Ack, MalformedFrame, Verdict
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.staging import StagedFrame, blocks_per_frame, stage_layer
from pdmesh.kv_transfer.stats import TransferStats
from pdmesh.kv_transfer.zmq_options import ACK_HWM, FRAME_HWM, POLL_MS, check_endpoint, tune
from pdmesh.logger import get_logger

log = get_logger(__name__)
# What a refusal most often means, in the error a user reads.
_REFUSAL_HINTS = {
    Verdict.BAD_SIZE: (
        " (the frames do not fit the receiver's cache: both workers need one model, block size "
        "and kv_cache_dtype)"
    ),
}

IDLE_LINK_SECONDS = 300.0  # a socket to an endpoint unused this long is closed


@dataclass(eq=False, repr=False)
class _TcpHandle(SendHandle):
    owner: TcpSender = field(init=False)
    future: Future[TransferStats] = field(default_factory=Future, init=False)
    # Written by the I/O thread only.
    queued: int = field(default=0, init=False)
    acked: int = field(default=0, init=False)
    sealed: bool = field(default=False, init=False)


class _Command(NamedTuple):
    kind: Literal["frame", "seal", "abort"]
    handle: _TcpHandle
    frame: StagedFrame | None = None
    reason: str = ""


@dataclass
class _Link:
    endpoint: str
    socket: zmq.Socket
    outbox: deque[tuple[_TcpHandle, StagedFrame]] = field(default_factory=deque)
    last_used: float = field(default_factory=time.monotonic)


class TcpSender(KVSender):
    Handle = _TcpHandle

    def __init__(self, geometry: PageGeometry, *, max_frame_bytes: int = MAX_FRAME_PAYLOAD) -> None:
        super().__init__(geometry)
        blocks_per_frame(geometry, max_frame_bytes)  # refuse a geometry now, not at the first push
        self._max_frame_bytes = max_frame_bytes
        self._context = zmq.Context(io_threads=1)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Callers wake the I/O thread through a socket pair, which its zmq poller can watch.
        self._wake_recv, self._wake_send = socket.socketpair()
        self._wake_recv.setblocking(False)
        self._wake_send.setblocking(False)
        self._active: set[tuple[str, bytes]] = set()
        self._closing = threading.Lock()  # taken by the first close(), never released
        self._stop = threading.Event()
        # I/O thread state.
        self._poller = zmq.Poller()
        self._links: dict[str, _Link] = {}
        self._handles: dict[tuple[str, bytes], _TcpHandle] = {}
        self._thread = threading.Thread(target=self._run, name="pdmesh-kv-send", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------
    def _open(self, handle: _TcpHandle) -> None:
        check_endpoint(handle.endpoint, binding=False)
        handle.owner = self
        key = (handle.endpoint, handle.raw_id)
        with self._lock:
            if self._stop.is_set():
                raise TransferError("the KV sender is closed")
            if key in self._active:
                raise ValueError(
                    f"transfer {handle.transfer_id} to {handle.endpoint} is already open on this "
                    "sender"
                )
            self._active.add(key)

    def send_layer(
        self, handle: SendHandle, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        h = self._own(handle)
        if h.ended:
            raise ValueError(f"{h!r}: send_layer after finish() or abort()")
        frames = stage_layer(self.geometry, h, layer, first_block, k, v, self._max_frame_bytes)
        if h.future.done():  # already refused or failed: finish() says why
            return
        for frame in frames:
            self._commands.put(_Command("frame", h, frame))
        self._wake()

    def finish(self, handle: SendHandle, timeout: float) -> TransferStats:
        h = self._own(handle)
        if not timeout > 0:
            raise ValueError(f"finish() needs a positive timeout in seconds, got {timeout!r}")
        if h.ended:
            raise ValueError(f"{h!r}: finish() or abort() was already called")
        h.ended = True
        if self._stop.is_set() and not h.future.done():
            raise TransferError(f"transfer {h.transfer_id}: the KV sender is closed")
        self._submit(_Command("seal", h))
        try:
            return h.future.result(timeout)
        except TimeoutError:
            reason = f"{h.acked} of {h.queued} frames acknowledged within {timeout:g} s"
            self._submit(_Command("abort", h, reason=reason))
            raise TransferError(
                f"transfer {h.transfer_id} to {h.endpoint}: {reason}; is the receiver there?"
            ) from None

    def abort(self, handle: SendHandle) -> None:
        h = self._own(handle)
        if not h.ended:
            h.ended = True
            self._submit(_Command("abort", h, reason="aborted by the sender"))

    def close(self) -> None:
        if not self._closing.acquire(blocking=False):
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=1.0 + 2 * POLL_MS / 1000)
        if self._thread.is_alive():
            log.warning("KV sender thread did not stop within 1 s")
            return
        self._take_commands()  # commands that raced with shutdown: fail their handles too
        self._context.term()
        self._wake_send.close()
        self._wake_recv.close()

    def _own(self, handle: SendHandle) -> _TcpHandle:
        if not isinstance(handle, _TcpHandle) or handle.owner is not self:
            raise ValueError(f"{handle!r} was not started by this sender")
        return handle

    def _submit(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake()

    def _wake(self) -> None:
        # Full: a wake-up is pending anyway. Closed: the thread is gone.
        with contextlib.suppress(OSError):
            self._wake_send.send(b"\0")

    # -- the I/O thread -----------------------------------------------------------------------
    def _run(self) -> None:
        self._poller.register(self._wake_recv.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(self._poller.poll(POLL_MS))
                self._drain_wake()
                self._take_commands()
                for link in list(self._links.values()):
                    if ready.get(link.socket, 0) & zmq.POLLIN:
                        self._read_acks(link)
                    self._flush(link)
                self._reap_idle_links()
        except Exception:
            log.exception("KV sender thread failed")
        finally:
            self._stop.set()  # no new transfers on a sender whose thread is gone
            for h in list(self._handles.values()):
                self._fail(h, "the KV sender closed")
            for link in self._links.values():
                link.socket.close(linger=0)
            self._links.clear()

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError once it is empty
            while self._wake_recv.recv(4096):
                pass

    def _take_commands(self) -> None:
        while True:
            try:
                kind, h, frame, reason = self._commands.get_nowait()
            except queue.Empty:
                return
            if h.future.done():
                continue
            if self._stop.is_set():
                self._fail(h, "the KV sender closed")
                continue
            self._handles.setdefault((h.endpoint, h.raw_id), h)
            if kind == "frame" and frame is not None:
                link = self._link(h)
                if link is not None:
                    link.outbox.append((h, frame))
                    h.queued += 1
            elif kind == "seal":
                h.sealed = True
                self._settle_if_complete(h)
            elif kind == "abort":
                self._fail(h, reason)

    def _link(self, h: _TcpHandle) -> _Link | None:
        link = self._links.get(h.endpoint)
        if link is not None:
            return link
        sock = self._context.socket(zmq.DEALER)
        tune(sock, h.endpoint)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing towards a receiver not connected
        sock.setsockopt(zmq.SNDHWM, FRAME_HWM)
        sock.setsockopt(zmq.RCVHWM, ACK_HWM)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)  # ms, doubling up to RECONNECT_IVL_MAX
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)  # a restarted decode worker: back in 1 s
        try:
            sock.connect(h.endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self._fail(h, f"cannot connect: {e}")
            return None
        link = self._links[h.endpoint] = _Link(h.endpoint, sock)
        self._poller.register(sock, zmq.POLLIN)
        return link

    def _flush(self, link: _Link) -> None:
        while link.outbox:
            h, frame = link.outbox[0]
            if h.future.done():
                link.outbox.popleft()
                continue
            frame.wait()  # CUDA: the device-to-host copy into the payload has landed
            try:
                link.socket.send_multipart(
                    [frame.header, frame.payload_bytes()], flags=zmq.NOBLOCK, copy=False
                )
            except zmq.Again:  # not connected, or its queue is full: POLLOUT will say when
                break
            except zmq.ZMQError as e:
                link.outbox.popleft()
                self._fail(h, f"sending failed: {e}")
                continue
            link.outbox.popleft()
            link.last_used = now = time.monotonic()
            if h.first_sent_at is None:
                h.first_sent_at = now
            h.nbytes += frame.nbytes
            with self._lock:
                self._counts.bytes_sent += frame.nbytes
                self._counts.frames_sent += 1
        flags = zmq.POLLIN | (zmq.POLLOUT if link.outbox else 0)
        self._poller.register(link.socket, flags)  # re-registering updates the flags

    def _read_acks(self, link: _Link) -> None:
        while True:
            try:
                parts = link.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = Ack.unpack(parts[0]) if len(parts) == 1 else None
            except MalformedFrame:
                ack = None
            if ack is None:
                log.warning("unreadable ack from %s ignored", link.endpoint)
                continue
            h = self._handles.get((link.endpoint, ack.transfer_id))
            if h is None:  # a transfer already settled (aborted, refused, timed out)
                continue
            if ack.verdict is Verdict.ACCEPTED:
                h.acked += 1
                self._settle_if_complete(h)
            else:
                self._fail(
                    h,
                    f"the receiver refused layer {ack.layer} blocks from {ack.first_block}: "
                    f"{ack.verdict.name.lower()}{_REFUSAL_HINTS.get(ack.verdict, '')}",
                )

    def _settle_if_complete(self, h: _TcpHandle) -> None:
        if not h.sealed or h.acked < h.queued:
            return
        self._forget(h)
        now = time.monotonic()
        stats = TransferStats(
            bytes=h.nbytes, seconds=now - (h.first_sent_at or now), frames=h.acked
        )
        with self._lock:
            self._counts.transfers += 1
            self._counts.seconds_sending += stats.seconds
        h.future.set_result(stats)

    def _fail(self, h: _TcpHandle, reason: str) -> None:
        if h.future.done():
            return
        self._forget(h)
        link = self._links.get(h.endpoint)
        if link is not None:  # free its staged buffers now
            link.outbox = deque(item for item in link.outbox if item[0] is not h)
        with self._lock:
            self._counts.transfers_failed += 1
        h.future.set_exception(TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {reason}"))

    def _forget(self, h: _TcpHandle) -> None:
        key = (h.endpoint, h.raw_id)
        if self._handles.get(key) is h:
            del self._handles[key]
        with self._lock:
            self._active.discard(key)

    def _reap_idle_links(self) -> None:
        now = time.monotonic()
        busy = {h.endpoint for h in self._handles.values()}
        for endpoint, link in list(self._links.items()):
            if (
                endpoint not in busy
                and not link.outbox
                and now - link.last_used > IDLE_LINK_SECONDS
            ):
                self._poller.unregister(link.socket)
                link.socket.close(linger=0)
                del self._links[endpoint]
