"""An offline CPU engine's freed activations stay in the process for its next step
(`pdmesh.processes.keep_freed_memory`): blocks as large as a layer's activations come from
malloc's heap, not from mmap, and stay there once freed (glibc's `mallinfo2` counts both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Each check runs in a fresh process: malloc's settings are per process. `heap` prints how many
# bytes malloc holds in mmapped blocks (hblkhd) and free in its heap (fordblks), in MiB, with a
# 16 MiB tensor (one layer's activations of a long prefill) alive and then freed.
HEAP = """
import ctypes, json, sys, torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def heap():
    info = libc.mallinfo2()
    return {"mmapped": info.hblkhd >> 20, "free": info.fordblks >> 20}

kept = None
if sys.argv[1] == "keep":
    from pdmesh.processes import keep_freed_memory
    kept = keep_freed_memory()
elif sys.argv[1] == "engine":
    from pdmesh import LLM
    llm = LLM(kv_cache_tokens=1024)
x = torch.empty(4 << 20).fill_(1.0)
alive = heap()
del x
print(json.dumps({"kept": kept, "alive": alive, "freed": heap()}))
"""


def _block(mode: str, keep: str = "1") -> dict:
    """Where the 16 MiB block lived (MiB mmapped for it) and what its free left in the heap
    (MiB of free heap it added), in a process started in `mode` (PDMESH_KEEP_FREED_MEMORY=keep)."""
    env = {**os.environ, "PDMESH_KEEP_FREED_MEMORY": keep}
    out = subprocess.run(
        [sys.executable, "-c", HEAP, mode], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    heap = json.loads(out.stdout.strip().splitlines()[-1])
    alive, freed = heap["alive"], heap["freed"]
    return {
        "kept": heap["kept"],
        "mmapped": alive["mmapped"] - freed["mmapped"],
        "held": freed["free"] - alive["free"],
    }


def test_glibcs_default_maps_a_large_block_and_returns_it() -> None:
    """The control: by default a 16 MiB block is mmapped, and unmapped when freed (its pages
    faulted in again on the next step)."""
    default = _block("default")
    assert default["mmapped"] >= 16 and default["held"] < 16, default


def test_kept_a_large_block_comes_from_the_heap_and_stays_there_when_freed() -> None:
    kept = _block("keep")
    assert kept["kept"] is True
    assert kept["mmapped"] == 0 and kept["held"] >= 16, kept  # held for the next allocation


def test_an_offline_cpu_engine_keeps_freed_memory() -> None:
    """Building an `LLM` on the CPU applies it."""
    engine = _block("engine")
    assert engine["mmapped"] == 0 and engine["held"] >= 16, engine


def test_pdmesh_keep_freed_memory_0_leaves_glibcs_default() -> None:
    off = _block("keep", keep="0")
    assert off["kept"] is False and off["mmapped"] >= 16, off


def test_the_prefill_bench_reports_time_faults_and_its_ceiling() -> None:
    """`python -m pdmesh.bench.prefill_cpu`: each round's time and page faults, the time in each
    part of the forward, and the projections' share of the time at the matrix-multiply rate
    measured beside them."""
    from pdmesh.bench.prefill_cpu import measure

    figures = measure(batch=2, prompt_len=32, rounds=2)
    assert len(figures["seconds"]) == len(figures["page_faults"]) == 2
    assert all(s > 0 for s in figures["seconds"])
    assert figures["matmul_gflops"] > 0 and 0 < figures["share_of_ceiling"] < 1.5, figures
    parts = figures["parts_ms"]  # the prefill's own kernels are reached and timed
    assert parts["projections"] > 0 and parts["attention"] > 0, parts
