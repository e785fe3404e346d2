"""The engine thread's contract at its end: every command still queued is failed, except those
whose caller gave up (a cancelled future), which are left alone rather than crashing the thread."""

from __future__ import annotations

import threading

import pytest

from pdmesh import LLM
from pdmesh.serving.engine_loop import EngineLoop


def test_commands_queued_at_stop_fail_and_cancelled_ones_are_skipped(default_llm: LLM) -> None:
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        loop = EngineLoop(default_llm.engine, on_deltas=lambda deltas: None)
        waiting = loop.call(lambda engine: 1)
        given_up = loop.call(lambda engine: 2)
        assert given_up.cancel()
        loop.fail("stopped before it ran")  # the thread then runs no command queued
        loop.start()
        loop.stop(timeout=5)
        with pytest.raises(RuntimeError, match="the engine has stopped"):
            waiting.result(timeout=1)
        assert given_up.cancelled()
        assert errors == []
    finally:
        threading.excepthook = old_hook
