"""Running a service until SIGINT/SIGTERM, with health going NOT_SERVING first."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import grpc

from pdmesh.logger import get_logger
from pdmesh.serving.grpc_server import Health

log = get_logger(__name__)


async def serve_until_stopped(
    server: grpc.aio.Server,
    health: Health,
    on_stop: Callable[[], Awaitable[None]],
    stop: asyncio.Event | None = None,
    grace_s: float = 2.0,
) -> None:
    """Mark SERVING, wait for a signal (or `stop`), then NOT_SERVING, stop, clean up."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await health.set(True)
    await stop.wait()
    # A second SIGTERM (a supervisor's own, after the first) must not kill the shutdown under
    # way: ignored from here to the exit (taken out of the loop's handlers, which its close
    # would reset to the default, deadly action).
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("shutting down")
    await health.set(False)
    await server.stop(grace_s)
    await on_stop()
