"""The tcp transport's receiver: one ROUTER socket and one daemon thread.

The thread reads [identity, header, payload] messages (ROUTER prepends the peer's identity),
hands them to a `TransferInbox`, which checks and writes them, and answers every parsed frame with
an ack on the same connection. The payload is written into the cache straight from zmq's receive
buffer (torch.frombuffer): the only copy on receipt is the one into the cache.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import zmq

from pdmesh.kv_transfer.base import KVReceiver
from pdmesh.kv_transfer.frame import HEADER_NBYTES, MAX_FRAME_PAYLOAD, Ack
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.inbox import TransferInbox
from pdmesh.kv_transfer.zmq_options import (
    ACK_HWM,
    FRAME_HWM,
    POLL_MS,
    RECV_BATCH,
    check_endpoint,
    tune,
)
from pdmesh.logger import get_logger

log = get_logger(__name__)


class TcpReceiver(KVReceiver):
    def __init__(
        self,
        cache: torch.Tensor,
        geometry: PageGeometry,
        bind: str,
        *,
        max_frame_bytes: int = MAX_FRAME_PAYLOAD,
    ) -> None:
        check_endpoint(bind, binding=True)
        if max_frame_bytes < HEADER_NBYTES:
            raise ValueError(f"max_frame_bytes {max_frame_bytes} is below one frame header")
        super().__init__(TransferInbox(cache, geometry))
        self._context = zmq.Context(io_threads=1)
        sock = self._context.socket(zmq.ROUTER)
        tune(sock, bind)
        sock.setsockopt(zmq.RCVHWM, FRAME_HWM)
        sock.setsockopt(zmq.SNDHWM, ACK_HWM)
        # Per message part: a peer announcing a bigger payload is disconnected by zmq before the
        # bytes are buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        try:
            sock.bind(bind)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self._context.term()
            raise ValueError(f"cannot bind the KV receiver to {bind}: {e}") from None
        self._socket = sock
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._closing = threading.Lock()  # taken by the first close(), never released
        self._thread = threading.Thread(
            target=self._run, name=f"pdmesh-kv-recv {self._endpoint}", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def close(self) -> None:
        if not self._closing.acquire(blocking=False):
            return
        self._stop.set()
        self._thread.join(timeout=1.0 + 2 * POLL_MS / 1000)
        self.inbox.close("the KV receiver closed")
        if self._thread.is_alive():  # stuck in a write; the daemon thread dies with the process
            log.warning("KV receiver thread at %s did not stop within 1 s", self._endpoint)
            return
        self._context.term()

    # -- the receiver thread ------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
                    for _ in range(RECV_BATCH):
                        try:
                            parts = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(parts)
                self.inbox.expire()
        except Exception:
            log.exception("KV receiver thread at %s failed", self._endpoint)
        finally:
            self._socket.close(linger=0)
            # Nobody will deliver or expire any more: fail what is open now, not at its deadline.
            stopped = "closed" if self._stop.is_set() else "thread failed"
            self.inbox.close(f"the KV receiver {stopped}")

    def _handle(self, parts: list[zmq.Frame]) -> None:
        identity, body = parts[0], parts[1:]
        header = body[0].buffer if body else b""
        payload = body[1].buffer if len(body) == 2 else None  # missing or extra parts: malformed
        try:
            verdict, parsed = self.inbox.deliver(header, payload)
        except Exception:  # never let one message stop the thread
            log.exception("KV frame from %r could not be handled", identity.bytes)
            return
        if parsed is None:  # not a frame at all: nobody to answer
            return
        ack = Ack(parsed.transfer_id, verdict, parsed.layer, parsed.first_block).pack()
        # ROUTER drops (never blocks) when the peer is gone or its queue is full.
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send_multipart([identity.bytes, ack], zmq.NOBLOCK)
