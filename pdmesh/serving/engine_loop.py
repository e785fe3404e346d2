"""An engine on its own thread, so model work never blocks an asyncio event loop.

Every touch of the engine happens on that thread: other threads hand it commands (run between
steps, in order) and receive each step's deltas through a callback.

A data-parallel rank under data-parallel attention (`lockstep`, see lockstep.py) steps whenever
any rank of its group has work, since their MoE layers exchange tokens within each step: it
waits for commands only when the last step ran nothing anywhere, and wakes its peers when work
comes to it then.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.logger import get_logger

log = get_logger(__name__)

T = TypeVar("T")
# How long the idle loop sleeps before running its tick (deadline checks) again.
IDLE_TICK_S = 0.05


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_deltas: Callable[[list[StepDelta]], None],
        on_tick: Callable[[LLMEngine], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        name: str = "engine",
        lockstep: bool = False,
        gathers_bursts: Callable[[], bool] = lambda: True,
    ) -> None:
        """lockstep: the engine is a data-parallel rank under data-parallel attention; set
        `wake_peers` to what tells its peers that it has work (lockstep.PeerWake.notify).
        gathers_bursts: asked each time the loop wakes from idle with new requests, whether
        to wait for the rest of their burst (False on a worker that only prefills: no decode
        runs there that a split burst would interleave with, see engine/scheduling/burst.py)."""
        self.engine = engine
        self.lockstep = lockstep
        self.gathers_bursts = gathers_bursts
        self.wake_peers: Callable[[], None] | None = None
        self._on_deltas = on_deltas
        self._on_tick = on_tick
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout)

    def fail(self, reason: str) -> None:
        """Declare the engine dead from any thread (a tensor-parallel rank died): the service
        goes down even if the engine thread is stuck in a collective with the dead rank."""
        log.error("engine failed: %s", reason)
        self._stopped.set()
        self._commands.put(None)
        if self._on_fatal is not None:
            self._on_fatal(RuntimeError(reason))

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread before its next step."""
        future: Future[T] = Future()
        if self._stopped.is_set():
            future.set_exception(RuntimeError("the engine has stopped"))
        else:
            self._commands.put((fn, future))
            # An idle group's ranks wait for their tick: this command's step needs them now.
            if self.wake_peers is not None and not self.engine.group_busy:
                self.wake_peers()
        return future

    def wake(self) -> None:
        """End a wait for commands now (any thread): a peer has work (lockstep)."""
        self._commands.put((_nothing, Future()))

    async def acall(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def publish(self, deltas: list[StepDelta]) -> None:
        """Hand deltas made by a command to the same callback as step deltas (engine thread
        only), so they reach consumers in the order they happened."""
        if deltas:
            self._on_deltas(deltas)

    def _drain(self, block: bool, timeout: float = IDLE_TICK_S) -> None:
        """Run the queued commands (block: waiting up to `timeout` for the first)."""
        while True:
            try:
                item = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:
                future.set_exception(exc)

    def _gather_burst(self) -> None:
        """Woken from idle by new requests: let the rest of their burst arrive before the first
        step (engine/scheduling/burst.py), for at most the engine's window."""
        engine = self.engine
        window = engine.prefill_rate.burst_window_s(
            engine.scheduler, engine.config.max_num_batched_tokens
        )
        deadline = time.monotonic() + window
        while not self._stopped.is_set() and (left := deadline - time.monotonic()) > 0:
            self._drain(block=True, timeout=left)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped.is_set():
                # A stalled engine waits for a command (a remote prefill landing) rather than
                # spinning through empty steps; in lockstep, only while its peers idle too.
                was_idle = not engine.has_unfinished_requests()
                idle_here = was_idle or engine.stalled
                self._drain(block=idle_here and not (self.lockstep and engine.group_busy))
                woken = was_idle and not self.lockstep and engine.has_unfinished_requests()
                if woken and self.gathers_bursts():
                    self._gather_burst()
                if self._stopped.is_set():
                    break
                if self._on_tick is not None:
                    self._on_tick(engine)
                if self.lockstep:  # every iteration steps once: one agreement with the peers
                    if not idle_here and not engine.group_busy and self.wake_peers is not None:
                        self.wake_peers()
                elif not engine.has_unfinished_requests():
                    continue
                deltas = engine.step()
                if deltas:
                    self._on_deltas(deltas)
        except BaseException as exc:
            self._failed(exc)
        self._fail_queued()

    def _failed(self, exc: BaseException) -> None:
        log.exception("engine loop failed")
        self._stopped.set()
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _fail_queued(self) -> None:
        """Fail whatever is still queued so no caller waits forever."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            # A caller that gave up meanwhile (its future cancelled) is owed nothing.
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError("the engine has stopped"))


def _nothing(engine: LLMEngine) -> None:
    """The command a wake queues: it only ends the wait."""
