"""A loopback TCP proxy a test can tell to stall (hold every byte) or cut (reset every connection
and refuse new ones): the network faults between a prefill worker and a decode worker."""

from __future__ import annotations

import select
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._accepting = True
        self._closed = False
        self.bytes_forwarded = 0
        threading.Thread(target=self._accept, daemon=True).start()

    # -- what a test does ---------------------------------------------------------------------
    def stall(self) -> None:
        """Stop forwarding: connections stay open, bytes sit unread (a black hole)."""
        self._forwarding.clear()

    def cut(self) -> None:
        """Reset every connection, and refuse new ones until `heal`."""
        with self._lock:
            self._accepting = False
        self._reset_all()

    def heal(self) -> None:
        """Back to normal: stalled connections are reset (their peers reconnect afresh)."""
        if not self._forwarding.is_set():
            self._reset_all()
        with self._lock:
            self._accepting = True
        self._forwarding.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self._reset_all()

    # -- machinery ----------------------------------------------------------------------------
    def _reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            for s in pair:
                # SO_LINGER 0: close sends RST, as a broken network path would.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                accepting = self._accepting
            if not accepting:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        try:
            while True:
                self._forwarding.wait()
                ready, _, _ = select.select([a, b], [], [], 0.1)
                if not self._forwarding.is_set():
                    continue  # stalled meanwhile: leave the bytes where they are
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    peer[s].sendall(data)
                    self.bytes_forwarded += len(data)
        except (OSError, ValueError):
            return  # reset or closed by cut()/heal()
