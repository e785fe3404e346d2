"""The zygote of pdmesh/warm_start.py: `python -m pdmesh.zygote FD` imports PRELOAD, then forks a
child per request read from the socket FD and reports each child's exit, until the other end
closes (the process that started it exited). A child becomes `python -m MODULE ARGS` as its
requester asked: working directory, environment, stdout and stderr, its command line in `ps`."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import Any

import pdmesh
from pdmesh.processes import die_with_parent

# What the zygote imports: what every worker, follower and replica imports first, and what
# costs the most (NumPy comes with torch). pdmesh's own modules stay out: they read PDMESH_*
# variables (the log level), which a child may set otherwise.
PRELOAD = ("torch", "numba")
PACKET = 1 << 20  # the largest packet read; a request larger than the socket takes fails to
# send, and its process starts as a new interpreter


def _serve(sock: socket.socket) -> None:
    """Import PRELOAD, say so, then fork a child per request and report each child's exit, until
    the other side closes the socket (its process exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the children; the zygote
    # ends with its parent
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _send(sock, {"ready": os.getpid()})
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    mine = [sock.fileno(), wake_r, wake_w, selector.fileno()]  # closed in each child
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                data, fds, _, _ = socket.recv_fds(sock, PACKET, 2)
                if not data:
                    return
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(data), fds, mine)
                for fd in fds:
                    os.close(fd)
                _send(sock, {"started": pid})
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _child(request: dict[str, Any], fds: list[int], zygote_fds: list[int]) -> None:
    """In the fork: become `python -m MODULE ARGS` started by the requester, its command line
    shown as such; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in zygote_fds:
            os.close(fd)
        die_with_parent()
        for target, fd in zip((1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        # `python -m` puts its working directory first on sys.path, and pdmesh takes it off
        # again where it is the checkout's root: the same for the child's directory.
        if _START_CWD in sys.path[:1]:
            sys.path.pop(0)
        sys.path.insert(0, request["cwd"])
        pdmesh.drop_checkout_root()
        _show_command([sys.executable, "-m", request["module"], *request["args"]])
        os.environ.clear()
        os.environ.update(request["env"])
        code = _run_module(request["module"], request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _show_command(argv: list[str]) -> None:
    """Show `argv` where `ps`, `top` and /proc/PID/cmdline show a process's command line, not
    the zygote's (setproctitle; where it is missing, the zygote's stays)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join(argv))


def _run_module(module: str, args: list[str]) -> int:
    """Run `module` as `python -m` runs it, then what the interpreter does at exit: wait for
    threads that are not daemons, run the atexit handlers, flush. Its exit code."""
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit step
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


_START_CWD = os.getcwd()

if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
