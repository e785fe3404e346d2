"""A supervisor of local child processes: start, restart with back-off, wait until ready, stop.

A child that exits is restarted after a delay that doubles with each exit in a row (2 s, 4 s, ...
30 s); one that had stayed up for `Backoff.reset_after_s` (60 s) before it exited starts again
from the shortest delay, as systemd's and Kubernetes' back-offs do: a worker that a rare bad
request takes down once an hour is back in 2 s, not 30. Children die with this process even if
it is killed outright (`die_with_parent`); `stop_all` sends SIGTERM, then SIGKILL after a grace.
Nothing here knows what the children are: `pdmesh up` (pdmesh/mesh.py) and the benchmarks say
which commands to run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdmesh.processes import die_with_parent
from pdmesh.warm_start import Process, start_module

STOP_GRACE_S = 10.0
RESTART_BASE_S = 2.0
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0


@dataclass(frozen=True)
class Backoff:
    """Restart delays: `base_s` after a first exit, doubling with each exit in a row up to
    `max_s`; an exit after `reset_after_s` or more of running counts as a first one again."""

    base_s: float = RESTART_BASE_S
    max_s: float = RESTART_MAX_S
    reset_after_s: float = RESTART_RESET_S

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s or self.reset_after_s <= 0:
            raise ValueError(
                f"a back-off needs 0 < base_s <= max_s and reset_after_s > 0, got {self!r}."
            )

    def delay(self, exits_in_a_row: int) -> float:
        return min(self.max_s, self.base_s * 2 ** (exits_in_a_row - 1))


@dataclass(frozen=True)
class ProcessSpec:
    """One child: its command line, where it serves, and what its exit means."""

    name: str
    command: list[str]
    address: str
    metrics: str | None = None  # its Prometheus endpoint
    env: dict[str, str] | None = None  # None: this process's environment
    restart: bool = True  # False: its exit ends supervision (`supervise` returns False)
    quiet: bool = False  # its stdout goes to /dev/null
    warm: bool = False  # a `python -m` command started as a fork of pdmesh/warm_start.py's zygote
    backoff: Backoff = field(default_factory=Backoff)


@dataclass
class Child:
    """A started `ProcessSpec` and its restart state."""

    spec: ProcessSpec
    proc: Process
    restarts: int = 0  # since supervision began
    exits_in_a_row: int = 0  # each within reset_after_s of its start: what the delay doubles on
    started_at: float = field(default_factory=time.monotonic)  # of the current process
    restart_at: float | None = None  # monotonic time of a scheduled restart
    last_delay_s: float = 0.0  # the delay before the restart scheduled last

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def metrics(self) -> str | None:
        return self.spec.metrics


def _start(spec: ProcessSpec) -> Process:
    if spec.warm and spec.command[:2] == [sys.executable, "-m"]:
        return start_module(spec.command[2], spec.command[3:], spec.env, spec.quiet)
    stdout = subprocess.DEVNULL if spec.quiet else None
    return subprocess.Popen(spec.command, stdout=stdout, env=spec.env, preexec_fn=die_with_parent)


def spawn(spec: ProcessSpec) -> Child:
    """Start one child; it gets SIGTERM when this process exits."""
    return Child(spec, _start(spec))


def supervise(children: list[Child]) -> bool:
    """One look at the children: restart those that exited, after their spec's back-off; False
    once a child with `restart=False` has exited."""
    now = time.monotonic()
    for c in children:
        if c.restart_at is not None and now >= c.restart_at:
            print(
                f"pdmesh: restarting {c.name} (restart {c.restarts})", file=sys.stderr, flush=True
            )
            c.proc = _start(c.spec)
            c.started_at = time.monotonic()
            c.restart_at = None
            continue
        if c.restart_at is not None or c.proc.poll() is None:
            continue
        if not c.spec.restart:
            print(f"pdmesh: {c.name} exited (code {c.proc.returncode}); stopping", file=sys.stderr)
            return False
        backoff = c.spec.backoff
        up_s = now - c.started_at
        c.restarts += 1
        c.exits_in_a_row = 1 if up_s >= backoff.reset_after_s else c.exits_in_a_row + 1
        c.last_delay_s = backoff.delay(c.exits_in_a_row)
        print(
            f"pdmesh: {c.name} exited (code {c.proc.returncode}) after {up_s:.0f} s up; "
            f"restarting in {c.last_delay_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        c.restart_at = now + c.last_delay_s
    return True


def wait_ready(
    children: list[Child], ready: Callable[[], bool], timeout_s: float, what: str = "the children"
) -> None:
    """Poll `ready` until it is true. RuntimeError if a child exits first, TimeoutError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [c for c in children if c.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].proc.returncode}")
        if ready():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} was not ready within {timeout_s:.0f} s")


def stop(proc: Process | subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM `proc`, SIGKILL if it still runs after `grace_s`; returns once it has exited."""
    if proc.poll() is None:
        proc.terminate()
    wait_or_kill(proc, grace_s)


def wait_or_kill(proc: Process | subprocess.Popen[Any], grace_s: float) -> None:
    """Wait up to `grace_s` for a process already told to stop, then SIGKILL it. No second
    SIGTERM: one arriving while a service takes its own handler down (pdmesh/serving/runner.py
    resets it to the default before ignoring it) killed a kvstore mid-shutdown in a test."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_all(children: list[Child]) -> None:
    """SIGTERM every child once, then SIGKILL those still running after STOP_GRACE_S."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for c in children:
        wait_or_kill(c.proc, max(0.1, deadline - time.monotonic()))
