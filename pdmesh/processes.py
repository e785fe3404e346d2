"""Small process helpers every layer uses: a free port to bind, dying with one's parent, a
service's quick exit, and its start-up heap kept out of the garbage collector's way."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import random
import signal
import socket
import sys
from typing import NoReturn

from pdmesh import envs

_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent exits
# Ports this process claimed (PDMESH_PORT_RANGE), each an abstract Unix socket held until exit.
_claims: list[socket.socket] = []


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (the caller binds it soon after). With
    PDMESH_PORT_RANGE, one of that range that no other process picked (claimed machine-wide for
    as long as this process lives), so that two meshes starting at once never get the same."""
    span = envs.port_range()
    if span is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    lo, hi = span
    start = random.randrange(lo, hi)
    for i in range(hi - lo):
        port = lo + (start - lo + i) % (hi - lo)
        if _claim(port) and _bindable(host, port):
            return port
    raise RuntimeError(f"no port of PDMESH_PORT_RANGE {lo}-{hi} is free")


def _claim(port: int) -> bool:
    """Claim `port` for this process (False: another process has)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0pdmesh-port-{port}")  # the abstract namespace: gone when the process is
    except OSError:
        s.close()
        return False
    _claims.append(s)
    return True


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits, so no rank or service outlives
    the process that started it."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_service(code: int) -> NoReturn:
    """End a service's process once it has shut down (its server stopped, its engine closed,
    its traces flushed): logs and streams flushed, then `os._exit`, without the interpreter's
    teardown. With torch and gRPC loaded that teardown took 1.4-1.8 s on 2 cores after the
    service had finished, and every stop, restart and role change waited for it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to save
            stream.flush()
    os._exit(code)


def freeze_heap() -> None:
    """Collect once, then move every object alive into the collector's permanent generation
    (`gc.freeze`), as vLLM does once its engine is up. A serving process's start-up leaves some
    200,000 long-lived objects (torch, transformers, the model's modules, gRPC), and every full
    collection would walk them all: on the 2-core CPU a decode worker paused 124-164 ms for
    each, every few seconds of streaming, and an inter-token gap then spanned two steps. Call
    once the process is ready to serve; what it creates afterwards is collected as usual."""
    gc.collect()
    gc.freeze()


# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back
    to the OS (vLLM's CPU workers preload tcmalloc to the same end). A CPU forward allocates
    each layer's activations afresh (a 2,048-token prefill of the default model: about 70 MB a
    layer); glibc served blocks that large with mmap and unmapped them on free, or trimmed them
    off the heap's top, so every prefill faulted its activations in again: some 390,000 page
    faults, and prefills of 8 x 256 tokens 1.15-1.2x slower, in an offline engine on the 2-core
    build machine (docs/benchmarks/cpu.md). Blocks under 1 GiB now come from the heap and stay
    there once freed; larger ones (a KV cache, allocated once) still use mmap.
    The offline engine (`LLM`) on a CPU calls this. A serving worker does not: its engine runs
    in a thread of its own, whose malloc arena did not fault so, and `vllm bench serve` against
    `pdmesh up --colocated` measured no gain (a few percent less, within the noise).
    False where the C library has no mallopt (musl, macOS) or PDMESH_KEEP_FREED_MEMORY=0."""
    if not envs.keep_freed_memory():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_THRESHOLD, _KEEP_BYTES), (_M_TRIM_THRESHOLD, _KEEP_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
