"""Two-rank process groups between one sender and one receiver, made on demand.

The receiver hosts a TCPStore at its endpoint. A sender announces a pair by appending a random
pair id to the store; both sides then build a 2-rank process group under that id's prefix
(receiver rank 1, sender rank 0): NCCL between GPUs, gloo between CPUs.

Frames travel in batches: the fixed-size headers of a batch go to the receiver as one message on
a TCP connection of the pair's own (to the socket the receiver listens on for the pair and names
in the store: `HeaderOutbox`, `HeaderInbox`); the batch's
payloads follow, back to back, as one send / recv over the group. The receiver posts a recv only
once headers have told it a payload is on its way: an NCCL recv left pending while idle would hold
a kernel on the decode GPU, and anything there that waits for the whole device (an allocation that
has to synchronise, a checksum over the cache) would wait for the next transfer. (The headers once
went through the store's queues: a blocking pop answered 0.1-0.7 ms after the push on an H200
host, which, paid per batch, set the pace of a transfer.)
"""

from __future__ import annotations

import datetime
import secrets
import select
import socket
import struct

import torch.distributed as dist

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.frame import HEADER_NBYTES, MalformedFrame

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=30)
# A receiver that does not answer within this is gone (the store client retries until then).
CONNECT_TIMEOUT = datetime.timedelta(seconds=5)
# A pair waits in recv for as long as no prompt is sent its way: its group must not time out.
IDLE_TIMEOUT = datetime.timedelta(days=7)
PAIR_COUNT_KEY = "pdmesh/kv/pairs"
# Python's GIL switch interval in a process with a KV pair (default 5 ms): its threads post
# sends and recvs while another thread runs a forward pass in Python.
GIL_SWITCH_S = 0.0005


def host_port(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"KV endpoint must look like tcp://HOST:PORT, got {endpoint!r}")
    host, _, port = endpoint[6:].rpartition(":")
    return host, int(port)


def serve_store(bind: str) -> dist.TCPStore:
    host, port = host_port(bind)
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS_TIMEOUT
    )


def join_store(endpoint: str) -> dist.TCPStore:
    host, port = host_port(endpoint)
    try:
        # A refused connection answers at once; the store client would retry until its timeout.
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT.total_seconds()).close()
        store = dist.TCPStore(host, port, is_master=False, timeout=CONNECT_TIMEOUT)
        store.set_timeout(RENDEZVOUS_TIMEOUT)
        return store
    except (OSError, RuntimeError, dist.DistStoreError) as e:
        raise TransferError(f"cannot reach the KV receiver at {endpoint}: {e}") from None


def announce_pair(store: dist.TCPStore) -> str:
    pair_id = secrets.token_hex(8)
    index = store.add(PAIR_COUNT_KEY, 1) - 1
    store.set(f"pdmesh/kv/pair/{index}", pair_id)
    return pair_id


def announced_pairs(store: dist.TCPStore, seen: int) -> list[str]:
    """Pair ids announced since the first `seen` ones."""
    count = store.add(PAIR_COUNT_KEY, 0)
    return [store.get(f"pdmesh/kv/pair/{i}").decode() for i in range(seen, count)]


# One batch: at most this many frames and payload bytes (at least one frame). A receiver holds a
# batch's payload in a buffer of its own until it is written into the cache, and posts the next
# batch's recv before it writes one (at most RECV_DEPTH batches' buffers at a time).
MAX_BATCH_FRAMES = 1024
BATCH_BYTES = 256 << 20
RECV_DEPTH = 4
# Frames queued that add up to this many bytes go at once on the caller's thread, even while a
# send is in flight (p2p_poster.py); smaller ones then wait for the pair's thread and go together.
COALESCE_BYTES = 32 << 20
HEADERS_PORT_KEY = "headers_port"
MAX_HEADERS = MAX_BATCH_FRAMES * HEADER_NBYTES  # a header message is at most this long
# A receiver that has not read a pair's headers for this long (its socket's buffer full, some
# hundreds of kilobytes of them behind) fails the sender's push.
HEADERS_SEND_TIMEOUT_S = 5.0
_LENGTH = struct.Struct("<I")


class HeadersClosed(Exception):
    """The sender closed its end of a pair's header channel."""


def pair_store(store: dist.Store, pair_id: str) -> dist.PrefixStore:
    """A pair's own keys: its group's rendezvous and the port of its header socket."""
    return dist.PrefixStore(f"pdmesh/kv/{pair_id}/", store)


def _bare(host: str) -> str:
    """A host as sockets take it ("[::1]" -> "::1")."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class HeaderOutbox:
    """The sending end of a pair's header channel: a TCP connection carrying one
    length-prefixed message per batch. A push does not wait on the receiver: it fails when the
    socket's buffer is full (the receiver has stopped reading)."""

    def __init__(self, store: dist.Store, pair_id: str, host: str) -> None:
        port = int(pair_store(store, pair_id).get(HEADERS_PORT_KEY))
        timeout = CONNECT_TIMEOUT.total_seconds()
        self._sock = socket.create_connection((_bare(host), port), timeout=timeout)
        _keepalive(self._sock)
        self._sock.setblocking(False)

    def push(self, headers: bytes) -> None:
        message = _LENGTH.pack(len(headers)) + headers
        try:
            sent = self._sock.send(message)
        except BlockingIOError:
            raise TransferError("the KV receiver takes no more headers") from None
        except OSError as e:
            raise TransferError(f"the KV receiver's header channel: {e}") from None
        if sent < len(message):  # the buffer filled up part way: the rest must follow
            self._sock.settimeout(HEADERS_SEND_TIMEOUT_S)
            try:
                self._sock.sendall(message[sent:])
            except OSError as e:
                raise TransferError(f"the KV receiver takes no more headers: {e}") from None
            finally:
                self._sock.setblocking(False)

    def close(self) -> None:
        self._sock.close()


class HeaderInbox:
    """The receiving end: a TCP socket listening for one pair, its port published in the store
    before the pair's group is made (the sender connects once the group is up). The first
    connection is the pair's; the listener closes then. A thread waiting here sleeps in the
    kernel without the GIL and wakes on the bytes themselves (zmq's PULL, used before, went
    through an I/O thread on each side: about twice the latency on the CPU)."""

    def __init__(self, store: dist.Store, pair_id: str, host: str) -> None:
        family = socket.AF_INET6 if ":" in _bare(host) else socket.AF_INET
        self._listener: socket.socket | None = socket.create_server((_bare(host), 0), family=family)
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        port = self._listener.getsockname()[1]
        pair_store(store, pair_id).set(HEADERS_PORT_KEY, str(port))

    def next(self, timeout_ms: int) -> bytes | None:
        """The next batch's headers, or None if none came within `timeout_ms` (0: no wait).
        MalformedFrame for a message longer than a batch's headers can be; HeadersClosed once
        the sender has closed its end."""
        message = self._pop()
        if message is not None:
            return message
        if self._sock is None:
            if not self._accept(timeout_ms):
                return None
            timeout_ms = 0
        assert self._sock is not None
        if not select.select([self._sock], [], [], timeout_ms / 1000)[0]:
            return None
        data = self._sock.recv(1 << 20)
        if not data:
            raise HeadersClosed()
        self._buf += data
        return self._pop()

    def _accept(self, timeout_ms: int) -> bool:
        assert self._listener is not None
        if not select.select([self._listener], [], [], timeout_ms / 1000)[0]:
            return False
        self._sock, _ = self._listener.accept()
        _keepalive(self._sock)
        self._listener.close()
        self._listener = None
        return True

    def _pop(self) -> bytes | None:
        if len(self._buf) < _LENGTH.size:
            return None
        (n,) = _LENGTH.unpack_from(self._buf)
        if not 0 < n <= MAX_HEADERS:
            raise MalformedFrame(f"a header message of {n} bytes (at most {MAX_HEADERS})")
        end = _LENGTH.size + n
        if len(self._buf) < end:
            return None
        message = bytes(self._buf[_LENGTH.size : end])
        del self._buf[:end]
        return message

    def close(self) -> None:
        for sock in (self._listener, self._sock):
            if sock is not None:
                sock.close()


def pair_group(store: dist.Store, pair_id: str, rank: int, backend: str) -> dist.ProcessGroup:
    prefixed = pair_store(store, pair_id)
    if backend == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = IDLE_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = IDLE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)
