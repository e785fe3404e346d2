"""The engine thread's contract at its end: every command still queued is failed, except those
whose caller gave up (a cancelled future), which are left alone rather than crashing the thread."""

from __future__ import annotations

import threading
import time

import pytest
from support import random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.scheduling.batch import ScheduledBatch
from pdmesh.engine.scheduling.burst import BURST_MAX_S, BURST_SHARE, PrefillRate
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


def test_an_idle_loop_keeps_a_burst_of_requests_together(default_llm: LLM) -> None:
    """Requests a client sends together arrive a few ms apart (each through the gateway, the
    router and the gRPC hops): an idle loop waits a share of the coming prefill for the rest
    (engine/scheduling/burst.py), so they prefill in one step instead of the first alone."""
    engine = default_llm.engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = random_prompts([256] * 5, seed=9)
    steps: list[set[str]] = []  # the requests with a token in each step
    loop = EngineLoop(engine, on_deltas=lambda ds: steps.append({d.request_id for d in ds}))
    loop.start()
    try:

        def run(ids: list[str], gap_s: float) -> None:
            for rid in ids:
                prompt = prompts[int(rid[-1])]
                loop.call(lambda e, rid=rid, p=prompt: e.add_request(rid, p, params))
                time.sleep(gap_s)
            deadline = time.monotonic() + 120
            while not all(loop.call(lambda e, r=r: e.is_finished(r)).result() for r in ids):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for rid in ids:
                loop.call(lambda e, r=rid: e.release(r)).result()

        run(["w0"], 0)  # times a prefill: the window is a share of the next one's estimate
        assert engine.prefill_rate.seconds_per_token is not None
        steps.clear()
        run(["b1", "b2", "b3", "b4"], 0.002)
        first = next(s for s in steps if s)
        assert first == {"b1", "b2", "b3", "b4"}, steps[:3]
    finally:
        loop.stop(timeout=5)


def test_the_burst_window_is_a_share_of_the_coming_prefill_capped() -> None:
    rate = PrefillRate()
    assert rate.window_s(256) == 0.0  # nothing timed yet: no wait
    rate.observe(ScheduledBatch([object()] * 8, [1] * 8, []), 0.1)  # decode rows: not counted
    assert rate.seconds_per_token is None
    rate.observe(ScheduledBatch([object()], [200], []), 0.4)  # 2 ms a prompt token
    assert rate.window_s(100) == pytest.approx(BURST_SHARE * 0.2)
    assert rate.window_s(100_000) == BURST_MAX_S


def test_a_step_read_after_the_loop_idled_does_not_count_as_its_time(tiny_model) -> None:
    """With async scheduling a step's tokens may be read long after they were ready (a prefill
    worker idles holding a prefill for its KV push): that wait is not the step's time, and must
    not swell the burst window (on two H200s it held every idle prefill worker at its 50 ms
    cap). Without async scheduling the step's launch-to-read time is its own."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = random_prompts([64], seed=3)[0]
    for async_scheduling in (True, False):
        folder = str(tiny_model("llama"))
        with LLM(folder, kv_cache_tokens=1024, async_scheduling=async_scheduling) as llm:
            engine = llm.engine
            engine.add_request("r", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                time.sleep(0.05)  # the loop idles between steps: the tokens wait for it
            if async_scheduling:  # read long after the CPU's forward made them
                assert engine.prefill_rate.seconds_per_token is None
            else:
                assert engine.prefill_rate.seconds_per_token is not None


def test_no_wait_when_the_waiting_prompts_fill_the_step_already() -> None:
    """A burst waits only for what could join the coming step: a prompt that fills the step's
    token budget on its own (or running sequences, or nothing waiting) means no wait."""
    from types import SimpleNamespace

    rate = PrefillRate()
    rate.observe(ScheduledBatch([object()], [200], []), 0.4)  # 2 ms a prompt token

    def scheduler(waiting: list[int], running: int = 0) -> SimpleNamespace:
        seqs = [SimpleNamespace(num_uncomputed_tokens=n) for n in waiting]
        return SimpleNamespace(waiting=seqs, running=[object()] * running)

    assert rate.burst_window_s(scheduler([256]), 2048) == rate.window_s(256) > 0
    assert rate.burst_window_s(scheduler([1024, 512]), 2048) == rate.window_s(1536)
    assert rate.burst_window_s(scheduler([2048]), 2048) == 0.0  # fills the step
    assert rate.burst_window_s(scheduler([4096]), 2048) == 0.0  # a chunk of it fills the step
    assert rate.burst_window_s(scheduler([256], running=1), 2048) == 0.0
    assert rate.burst_window_s(scheduler([]), 2048) == 0.0


def test_a_loop_that_does_not_gather_bursts_steps_at_once(default_llm: LLM) -> None:
    """A worker that only prefills runs no decode that a split burst would land in, so its loop
    starts a woken step at once (an isolated prompt on a GPU paid ~5 ms for nothing); a loop
    that gathers waits its window. The window is made 30 s here, so either shows."""
    engine = default_llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = random_prompts([64], seed=4)[0]
    rate = engine.prefill_rate
    original = rate.burst_window_s
    rate.burst_window_s = lambda scheduler, budget: 30.0  # type: ignore[method-assign]
    try:
        for gathers in (False, True):
            rid = f"r{gathers}"
            done = threading.Event()

            def on_deltas(ds: list, done: threading.Event = done) -> None:
                if any(d.finish_reason for d in ds):
                    done.set()

            loop = EngineLoop(engine, on_deltas, gathers_bursts=lambda g=gathers: g)
            loop.start()
            try:
                loop.call(lambda e, r=rid: e.add_request(r, prompt, params))
                assert done.wait(3.0) is not gathers  # finished: it did not wait 30 s
                loop.call(lambda e, r=rid: e.abort_request(r)).result(timeout=60)
                loop.call(lambda e, r=rid: e.release(r)).result(timeout=60)
            finally:
                loop.stop(timeout=5)
    finally:
        rate.burst_window_s = original  # type: ignore[method-assign]


def test_workers_gather_bursts_where_they_decode() -> None:
    """Decode and colocated workers keep a burst together; a prefill worker, or a role-switching
    worker while it serves prefill, does not (engine_loop.gathers_bursts reads the role)."""
    from types import SimpleNamespace

    from pdmesh.serving.worker_process import WorkerProcess

    class Worker(WorkerProcess):
        role = "decode"

        def _on_engine_deltas(self, deltas: list) -> None:
            pass

    engine = SimpleNamespace(runner=SimpleNamespace(dp=None), tp_driver=None)
    worker = Worker(engine, SimpleNamespace(geometry=None))  # type: ignore[arg-type]
    assert worker.loop.gathers_bursts()
    worker.role = "prefill"
    assert not worker.loop.gathers_bursts()
    worker.role = "decode"
    assert worker.loop.gathers_bursts()
