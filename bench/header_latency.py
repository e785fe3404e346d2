"""One-way latency of a small message between two processes on one host: zmq PUSH/PULL (the KV
pairs' header channel) against a plain TCP socket, with the receiving process's main thread idle
or busy running Python (as a decode worker's engine thread is).

    python -m pdmesh.bench.header_latency [--out DIR]

The receiving thread waits as the KV receiver's pair thread does (zmq: poll with a timeout, then
a non-blocking recv; TCP: a blocking recv); the sender stamps CLOCK_MONOTONIC (one clock for
every process of the host) into each message. Medians, p90 and minimum in µs, after 10 messages
not counted.
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from pdmesh.bench.report import Report, out_parser

MESSAGES = 300
GAP_S = 0.002  # between two messages
SWITCH_S = 0.0005  # the GIL's switch interval in a process with a KV pair (p2p_pairs.py)
STAMP = struct.Struct("<d")
LENGTH = struct.Struct("<I")
PAYLOAD = b"x" * 150  # two headers' worth


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(200):
            x += i * i


def _receive_zmq(ready: Callable[[int], None]) -> Callable[[], float]:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    ready(sock.bind_to_random_port("tcp://127.0.0.1"))

    def one() -> float:
        while not sock.poll(50):
            pass
        message = sock.recv(zmq.NOBLOCK)
        return time.monotonic() - STAMP.unpack_from(message)[0]

    return one


def _receive_tcp(ready: Callable[[int], None]) -> Callable[[], float]:
    server = socket.create_server(("127.0.0.1", 0))
    ready(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def one() -> float:
        (n,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
        message = conn.recv(n, socket.MSG_WAITALL)
        return time.monotonic() - STAMP.unpack_from(message)[0]

    return one


def _send(kind: str, port: int) -> None:
    if kind == "zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.2)  # connected before the first message
        for _ in range(MESSAGES):
            sock.send(STAMP.pack(time.monotonic()) + PAYLOAD)
            time.sleep(GAP_S)
        time.sleep(0.2)
        return
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(MESSAGES):
        message = STAMP.pack(time.monotonic()) + PAYLOAD
        conn.sendall(LENGTH.pack(len(message)) + message)
        time.sleep(GAP_S)


def measure(kind: str, busy: bool) -> dict[str, float]:
    """One-way latencies of MESSAGES messages from a child process, in µs."""
    ports: list[int] = []
    got = threading.Event()
    latencies: list[float] = []
    done = threading.Event()

    def ready(port: int) -> None:
        ports.append(port)
        got.set()

    def receive() -> None:
        one = (_receive_zmq if kind == "zmq" else _receive_tcp)(ready)
        latencies.extend(one() for _ in range(MESSAGES))
        done.set()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    got.wait(10)
    child = subprocess.Popen(
        [sys.executable, "-m", "pdmesh.bench.header_latency", "--send", kind, str(ports[0])]
    )
    if busy:
        _busy(done)
    thread.join(60)
    child.wait(60)
    kept = sorted(latencies[10:])
    return {
        "p50_us": round(statistics.median(kept) * 1e6, 1),
        "p90_us": round(kept[int(len(kept) * 0.9)] * 1e6, 1),
        "min_us": round(kept[0] * 1e6, 1),
    }


def main() -> None:
    if sys.argv[1:2] == ["--send"]:
        _send(sys.argv[2], int(sys.argv[3]))
        return
    args = out_parser(__doc__, out_required=False).parse_args()
    sys.setswitchinterval(SWITCH_S)
    result = {
        f"{kind}_{'busy' if busy else 'idle'}": measure(kind, busy)
        for kind in ("zmq", "tcp")
        for busy in (False, True)
    }
    for name, figures in result.items():
        print(f"{name:10s} {figures}")
    if args.out:
        Report(args.out / "header_latency.json", **result).save()


if __name__ == "__main__":
    main()
