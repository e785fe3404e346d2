"""Reads a tensor through the GPU's L2 cache, so that the next kernel to read it finds it there.

A batch-1 decode step leaves the memory idle while its small kernels run (rotary, the KV store,
decode attention and its merge: each reads a few kilobytes); a weight read during them, beside
them on another stream, costs the step nothing, and the projection after them then reads it from
the L2 instead of HBM. The tensor is read as int32 words, grid-stride, by one program per SM at
most (the kernels beside it keep the rest of each SM), and kept in the L2 before other lines
(`evict_last`; PTX allows no L1 bypass with it). Each program stores the XOR of the words it read, so the read
is observable and cannot be dropped by the compiler.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdmesh.kernels.backend import register_triton

BLOCK = 8192  # words a program reads an iteration: 32 KiB, eight 16-byte loads a thread


@triton.jit
def _read_kernel(src_ptr, sink_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, stride):
        idx = start + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < n, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.xor_sum(acc, axis=0))


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, to exercise the grid stride
    return torch.cuda.get_device_properties(device).multi_processor_count


@register_triton("read_into_l2")
def read_into_l2(t: torch.Tensor) -> torch.Tensor:
    # t: any dense tensor of a multiple of 4 bytes -> [programs] int32, XORs of its words
    words = t.reshape(-1).view(torch.int32)
    n = words.numel()
    if n >= 2**31:
        raise ValueError(f"a tensor of {n} int32 words is too large to read into the L2")
    programs = max(1, min(_programs(t.device), triton.cdiv(n, BLOCK)))
    sink = torch.empty(programs, dtype=torch.int32, device=t.device)
    _read_kernel[(programs,)](words, sink, n, BLOCK=BLOCK, num_warps=8)
    return sink
