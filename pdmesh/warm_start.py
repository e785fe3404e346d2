"""Processes started from a warm interpreter: `python -m MODULE ARGS` run in a fork of a process
that has imported torch already, instead of in a new interpreter.

Why: a worker, a follower rank or a data-parallel replica spent its first seconds importing torch
and Numba (`python -X importtime` on the 2-core build machine: 3.4 s of the 4.3 s a decode
worker imports, before any of pdmesh runs). `pdmesh up` starts one such process per worker, a
tensor-parallel engine one per follower rank, and every restart or role change another. vLLM
forks its workers for the same reason where CUDA is not initialised yet.

How: a process's first warm start runs a zygote (`python -m pdmesh.zygote FD`), which imports
its PRELOAD and nothing else, then forks a child per request. Requests and replies are JSON
packets on a socket pair, no pickle; a request carries the caller's stdout and stderr
(SCM_RIGHTS), so a child writes where a `subprocess.Popen` child of the caller would. The child
takes the request's working directory and environment, dies with the zygote (which dies with the
thread that started it: a daemon thread of this module, alive as long as the process), and runs
the module as the interpreter would (`runpy`, `__main__`, its exit code). The zygote reaps its
children and reports each exit code; `WarmProcess` answers as `subprocess.Popen` does.

Safe to fork: the zygote has run nothing, only imported. No CUDA context, no OpenMP pool, no gRPC
core, no thread but OpenBLAS's, which re-forms itself in a child. Each zygote's imports read its
environment (OMP_NUM_THREADS, say), so a start is served by a zygote whose environment equals its
own in every variable that the interpreter, the dynamic loader, torch, NumPy, OpenMP, BLAS or
Numba may read at import (`read_at_import`); others (PDMESH_*, CUDA_VISIBLE_DEVICES, the test
runner's PYTEST_CURRENT_TEST) are read when used, in the child. A start none serves gets a new
zygote (at most MAX_ZYGOTES running), else a new interpreter, as does every start where
PDMESH_WARM_START=0 or off Linux.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from pdmesh import envs
from pdmesh.processes import die_with_parent
from pdmesh.zygote import PACKET

START_TIMEOUT_S = 120.0  # the zygote's imports on a loaded 2-core machine take ~5 s


def start_module(
    module: str, args: list[str], env: dict[str, str] | None = None, quiet: bool = False
) -> Process:
    """`python -m MODULE ARGS` with `env` (None: this process's environment) and this process's
    stdout (`quiet`: none), dying with this process (`die_with_parent`): a fork of this process's
    zygote where it can serve the environment, else a new interpreter."""
    env = dict(os.environ if env is None else env)
    if envs.warm_start() and sys.platform == "linux":
        zygote = _zygote(env)
        if zygote is not None:
            proc = zygote.start(module, args, env, quiet)
            if proc is not None:
                return proc
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.DEVNULL if quiet else None,
        preexec_fn=die_with_parent,
    )


class WarmProcess:
    """A zygote's child as `subprocess.Popen` shows one: `pid`, `returncode` (negative: the
    signal that ended it), `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, pid: int, zygote: _Zygote, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._zygote = zygote

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._zygote.alive:
            # Its zygote died, and with it the reports of its exit: the child got SIGTERM
            # (it dies with the zygote) and is gone once no signal reaches it.
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._ended(-signal.SIGTERM)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the child has exited; subprocess.TimeoutExpired after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._exited.wait(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = subprocess.Popen[bytes] | WarmProcess  # what start_module returns


# -- this side of the zygote --------------------------------------------------------------------


class _Zygote:
    """This process's zygote: started, and its reports read, by a daemon thread of its own (the
    zygote dies with that thread, so with this process); one request at a time, answered in
    order."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.alive = False
        self._sock, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()  # one request at a time
        self._state = threading.Lock()  # the two dictionaries below
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._children: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before this side saw the start
        threading.Thread(target=self._run, name="pdmesh-zygote", daemon=True).start()
        ready = self._replies.get(timeout=START_TIMEOUT_S)
        self.alive = "ready" in ready

    def start(
        self, module: str, args: list[str], env: dict[str, str], quiet: bool
    ) -> WarmProcess | None:
        """A child running `module`, or None (the caller starts a new interpreter) if the zygote
        is gone or this process has no stdout or stderr to hand it."""
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd()}
        try:  # where Popen's child would write; closed in a daemon, say: no warm start then
            os.fstat(2)
            out = os.open(os.devnull, os.O_WRONLY) if quiet else os.dup(1)
        except OSError:
            return None
        try:
            with self._lock:
                data = json.dumps(request).encode()
                socket.send_fds(self._sock, [data], [out, 2])
                reply = self._replies.get(timeout=START_TIMEOUT_S)
                if "started" not in reply:
                    return None
                pid = reply["started"]
                proc = WarmProcess(pid, self, [module, *args])
                with self._state:
                    if pid in self._early:
                        proc._ended(self._early.pop(pid))
                    else:
                        self._children[pid] = proc
                return proc
        except (OSError, queue.Empty):
            self.alive = False  # gone, or too slow to trust its order of replies: none is used
            return None
        finally:
            os.close(out)

    def has_children(self) -> bool:
        """Whether a child of this zygote may still run (its exit not reported yet)."""
        with self._state:
            return bool(self._children)

    def end(self) -> None:
        """End the zygote: it exits once it reads the end of the socket (its children, none
        running, would get SIGTERM)."""
        self.alive = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            zygote = subprocess.Popen(
                [sys.executable, "-m", "pdmesh.zygote", str(self._theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=self.env,
                pass_fds=[self._theirs.fileno()],
                preexec_fn=die_with_parent,
            )
        except OSError:
            self._replies.put({"error": "could not start"})
            return
        self._theirs.close()
        while True:
            try:
                data = self._sock.recv(PACKET)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exited" in message:
                pid, code = message["exited"], message["code"]
                with self._state:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early[pid] = code
                if child is not None:
                    child._ended(code)
            else:
                self._replies.put(message)
        self.alive = False
        zygote.wait()
        self._replies.put({"error": "the zygote exited"})


MAX_ZYGOTES = 2  # per process: each holds torch's ~300 MB, mostly shared with its children;
# beyond them, the least recently used one without a child running ends to make room
_ImportEnv = frozenset[tuple[str, str]]
_zygotes: dict[_ImportEnv, _Zygote] = {}  # by the environment their imports read
_failed: set[_ImportEnv] = set()  # a zygote with this environment never became ready
_owner = os.getpid()  # a fork of this process starts zygotes of its own
_zygotes_lock = threading.Lock()


def _zygote(env: dict[str, str]) -> _Zygote | None:
    """The zygote of this process whose imports read what `env` holds, started on first use and
    again if it died; None where one could not start, or MAX_ZYGOTES others have children."""
    global _owner
    key = frozenset((k, v) for k, v in env.items() if read_at_import(k))
    with _zygotes_lock:
        if _owner != os.getpid():
            _owner = os.getpid()
            _zygotes.clear()
            _failed.clear()
        zygote = _zygotes.pop(key, None)
        if zygote is not None and zygote.alive:
            _zygotes[key] = zygote  # the most recently used last
            return zygote
        if key in _failed or not _make_room():
            return None
        try:
            zygote = _Zygote(env)
        except queue.Empty:
            zygote = None
        if zygote is None or not zygote.alive:
            _failed.add(key)
            _zygotes.pop(key, None)
            return None
        _zygotes[key] = zygote
        return zygote


# What the interpreter (PYTHON*), the dynamic loader (LD_*), torch, NumPy, OpenMP, MKL, OpenBLAS,
# Numba and the CUDA libraries read of their environment, some of it when loaded.
_IMPORT_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "NUMPY", "OMP_", "GOMP_", "KMP_", "MKL_")
_IMPORT_PREFIXES += ("OPENBLAS", "NUMBA_", "CUDA_", "NVIDIA_")


def _make_room() -> bool:
    """Whether another zygote may start: fewer than MAX_ZYGOTES run, or the least recently used
    of those without a running child was ended (`_zygotes` lists them least recent first)."""
    for key, zygote in list(_zygotes.items()):
        if len(_zygotes) < MAX_ZYGOTES:
            break
        if not zygote.alive or not zygote.has_children():
            zygote.end()
            del _zygotes[key]
    return len(_zygotes) < MAX_ZYGOTES


def read_at_import(name: str) -> bool:
    """Whether a variable may be read while PRELOAD is imported (the zygote's, then). The GPUs a
    process may see are read when CUDA initialises, in the child."""
    return name.startswith(_IMPORT_PREFIXES) and name != "CUDA_VISIBLE_DEVICES"
