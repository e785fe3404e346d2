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
    on_sigterm: Callable[[], Awaitable[object]] | None = None,
    before_server_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Mark SERVING, wait for a signal (or `stop`), then NOT_SERVING, stop, clean up. With
    `on_sigterm`, SIGTERM goes NOT_SERVING and awaits it (a drain) before stopping; SIGINT
    stops at once. `before_server_stop`: awaited once NOT_SERVING, before the server stops (ending
    long-lived streams, which the stop's grace would wait for)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if on_sigterm is None:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    else:
        tasks: list[asyncio.Task[None]] = []

        async def drain_then_stop() -> None:
            try:
                await health.set(False)
                await on_sigterm()
            except Exception:
                log.exception("draining on SIGTERM failed; stopping")
            stop.set()

        def sigterm() -> None:
            if not tasks:  # a second SIGTERM while draining changes nothing
                tasks.append(loop.create_task(drain_then_stop()))

        loop.add_signal_handler(signal.SIGTERM, sigterm)
    await health.set(True)
    await stop.wait()
    # A second SIGTERM (a supervisor's own, after the first) must not kill the shutdown under
    # way: ignored from here to the exit (taken out of the loop's handlers, which its close
    # would reset to the default, deadly action).
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("shutting down")
    await health.set(False)
    if before_server_stop is not None:
        await before_server_stop()
    await server.stop(grace_s)
    await on_stop()
