"""Two-rank process groups between one sender and one receiver, made on demand.

The receiver hosts a TCPStore at its endpoint. A sender announces a pair by appending a random
pair id to the store; both sides then build a 2-rank process group under that id's prefix
(receiver rank 1, sender rank 0): NCCL between GPUs, gloo between CPUs.

Frames travel in batches: the fixed-size headers of a batch go to the receiver as one zmq message
(PUSH to the PULL socket the receiver binds for the pair and names in the store); the batch's
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
import socket

import torch.distributed as dist
import zmq

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.frame import HEADER_NBYTES
from pdmesh.kv_transfer.zmq_options import tune

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
# Frames queued that add up to this many bytes are posted at once on the caller's thread
# (p2p_poster.py); fewer wait for the pair's thread, which posts everything queued together.
COALESCE_BYTES = 32 << 20
HEADERS_PORT_KEY = "headers_port"
HEADERS_HWM = 10_000  # header messages queued per pair (tiny; a sender fails past it)


def pair_store(store: dist.Store, pair_id: str) -> dist.PrefixStore:
    """A pair's own keys: its group's rendezvous and the port of its header socket."""
    return dist.PrefixStore(f"pdmesh/kv/{pair_id}/", store)


class HeaderOutbox:
    """The sending end of a pair's header channel: one message per batch, never blocking."""

    def __init__(self, store: dist.Store, pair_id: str, host: str) -> None:
        port = int(pair_store(store, pair_id).get(HEADERS_PORT_KEY))
        endpoint = f"tcp://{host}:{port}"
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        tune(self._sock, endpoint)
        self._sock.setsockopt(zmq.SNDHWM, HEADERS_HWM)
        self._sock.connect(endpoint)

    def push(self, headers: bytes) -> None:
        try:
            self._sock.send(headers, zmq.NOBLOCK)
        except zmq.Again:
            raise TransferError("the KV receiver takes no more headers") from None

    def close(self) -> None:
        self._sock.close()


class HeaderInbox:
    """The receiving end: a PULL socket bound for one pair, its port published in the store
    before the pair's group is made (the sender reads it once the group is up)."""

    def __init__(self, store: dist.Store, pair_id: str, host: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        tune(self._sock, f"tcp://{host}:0")
        self._sock.setsockopt(zmq.RCVHWM, HEADERS_HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_FRAMES * HEADER_NBYTES)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        pair_store(store, pair_id).set(HEADERS_PORT_KEY, str(port))

    def next(self, timeout_ms: int) -> bytes | None:
        """The next batch's headers, or None if none came within `timeout_ms` (0: no wait)."""
        if timeout_ms and not self._sock.poll(timeout_ms):
            return None
        try:
            return self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def close(self) -> None:
        self._sock.close()


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
