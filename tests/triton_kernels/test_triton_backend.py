"""Kernel selection: Triton is imported only when a kernel could run on it, once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

# Run in a fresh interpreter: this test process has imported the Triton kernels already.
PROBE = """
import sys
import torch
import pdmesh.kernels
from pdmesh.kernels import backend, silu_and_mul
from pdmesh.kernels.activation import silu_and_mul_ref

# SiLU-and-mul: a Triton kernel, and none of the CPU's (whose kernels would not be the reference)
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(4, 64, device=device if "{where}" == "device" else "cpu")
torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))
chosen = backend.pick("silu_and_mul", x, silu_and_mul_ref)
print("loaded" if "pdmesh.kernels.triton" in sys.modules else "not-loaded",
      "triton" if chosen is not silu_and_mul_ref else "reference")
"""


def _probe(backend: str, where: str, block_triton: bool = False) -> str:
    env = dict(os.environ, PDMESH_KERNEL_BACKEND=backend)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    code = PROBE.format(where=where)
    if block_triton:  # as if triton were not installed
        code = "import sys; sys.modules['triton'] = None\n" + code
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 or block_triton, done.stderr
    return (done.stdout.strip() or done.stderr.strip().splitlines()[-1]).strip()


def test_cpu_tensors_on_auto_never_import_triton() -> None:
    assert _probe("auto", "cpu") == "not-loaded reference"


def test_forcing_triton_imports_the_kernels_on_first_use() -> None:
    assert _probe("triton", "device") == "loaded triton"


def test_forcing_triton_without_triton_installed_says_so() -> None:
    message = _probe("triton", "device", block_triton=True)
    assert "RuntimeError" in message and "triton" in message.lower()


REFERENCE_PROBE = """
import torch
from pdmesh.kernels import backend
from pdmesh.kernels.prologue import rotary_and_store_kv_unfused

x = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
before = backend.pick("rotary_and_store_kv", x, rotary_and_store_kv_unfused)
backend.run_reference("rotary_and_store_kv")
after = backend.pick("rotary_and_store_kv", x, rotary_and_store_kv_unfused)
print(before is not rotary_and_store_kv_unfused, after is rotary_and_store_kv_unfused)
try:
    backend.run_reference("no_such_kernel")
except ValueError as e:
    print(e)
"""


def test_run_reference_puts_a_kernel_back_to_its_reference() -> None:
    """What bench/without_kernel.py relies on: the fused kernel picked, then its reference."""
    env = dict(os.environ, PDMESH_KERNEL_BACKEND="triton", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-c", REFERENCE_PROBE]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.split("\n")[:2]
    assert lines == ["True True", "no kernel 'no_such_kernel' is registered"], out.stderr[-2000:]
