"""Programmatic dependent launch (PDL, compute capability 9.0 and newer): a kernel launched while
the kernel before it in the stream still runs, so that its launch, its programs' start and its
reads of what the kernel before it does not write (a GEMV's weights) overlap that kernel's tail.

A kernel taking part has a USE_PDL constexpr and calls `wait_for_previous(USE_PDL)` before it
reads or writes anything the kernels before it write or read (only constant data before it); the
wait returns once the kernel before it has finished and its writes are visible. The call also
lets the next kernel launch early. Its launch passes `**pdl_launch(use)`. PDMESH_PDL=0 turns it off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdmesh import envs


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait for the kernel before this one (a no-op without PDL), then let the next one launch:
    its programs take the SMs this kernel's programs leave and wait in turn."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch
    (PDMESH_PDL): CUDA devices of compute capability 9.0 or newer."""
    if device.type != "cuda" or not envs.pdl():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0)


def pdl_launch(use: bool) -> dict[str, bool]:
    """The launch options for a kernel launched with programmatic dependent launch or not (none
    when not: the Triton interpreter takes no such option)."""
    return {"launch_pdl": True} if use else {}
