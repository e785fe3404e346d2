"""Small process helpers every layer uses: a free port to bind, and dying with one's parent."""

from __future__ import annotations

import ctypes
import signal
import socket

_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent exits


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits, so no rank or service outlives
    the process that started it."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
