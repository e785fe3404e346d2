"""Endpoint syntax and socket options shared by the tcp receiver and sender.

The options are about failing fast and bounding memory: no lingering on close, small queues of
(large) frames, and keepalives plus zmq heartbeats so a peer that vanished without a FIN (power
loss, network partition) is noticed in seconds rather than at the kernel's two-hour default.
"""

from __future__ import annotations

import re

import zmq

POLL_MS = 50  # a transport thread wakes at least this often: deadlines, shutdown
RECV_BATCH = 64  # messages read per wake-up before deadlines are looked at again

# zmq high-water marks count messages, per peer. Frames are up to MAX_FRAME_PAYLOAD bytes, so a
# few in flight keep the link busy without letting one peer pin gigabytes; acks are tiny.
FRAME_HWM = 8
ACK_HWM = 100_000

_ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-*]+):(?P<port>\*|\d{1,5})")


def check_endpoint(endpoint: str, *, binding: bool) -> None:
    """ValueError unless `endpoint` is tcp://host:port (a bind may use host * and port 0 or *)."""
    match = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if match is None:
        raise ValueError(f"a KV endpoint looks like tcp://127.0.0.1:5555, got {endpoint!r}")
    host, port = match["host"], match["port"]
    if binding:
        if port != "*" and int(port) > 65535:
            raise ValueError(f"port {port} of {endpoint!r} is not a TCP port")
        return
    if host == "*" or port == "*" or not 1 <= int(port) <= 65535:
        raise ValueError(f"cannot connect to {endpoint!r}: name a host and a port in 1..65535")


def tune(sock: zmq.Socket, endpoint: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # close() never waits on a dead peer
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ms
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
