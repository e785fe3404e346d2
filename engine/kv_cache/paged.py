"""The paged KV cache tensors and how many blocks fit.

Layout: one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]. A
block of one layer is contiguous, so a transfer of block ids moves whole pages. Its dtype is the
model's or float8 e4m3 (`kv_cache_dtype="fp8"`: engine/layers/attention.py holds the scales).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

CPU_DEFAULT_FRACTION = 0.1
GPU_DEFAULT_FRACTION = 0.9


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if spec.dtype == torch.float8_e4m3fn:
            check_fp8_device(device)
        # Zeroed, not empty: padded reads (masked out) must never meet NaN bit patterns.
        self.data = torch.zeros(shape, dtype=spec.dtype, device=device)

    def bind(self, attention_layers: list[nn.Module]) -> None:
        if len(attention_layers) != self.spec.num_layers:
            raise RuntimeError(
                f"{len(attention_layers)} attention layers, cache has {self.spec.num_layers}"
            )
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = self.data[i, 0], self.data[i, 1]

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """pairs [2, C] int64 on the cache's device: block pairs[1][i] gets a copy of block
        pairs[0][i]'s K and V in every layer this rank holds. All sources are read before any
        copy is written, so a block may be a source and (later in the list) a copy."""
        self.data[:, :, pairs[1]] = self.data[:, :, pairs[0]]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def check_fp8_device(device: torch.device) -> None:
    """ValueError unless `device` can run an fp8 cache's kernels: a CPU (the torch references),
    or a GPU of compute capability 8.9 or newer (Ada, Hopper: Triton's e4m3 conversions)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this one is {major}.{minor}: use kv_cache_dtype='auto'."
        )


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    kv_cache_tokens: int | None,
    memory_fraction: float | None,
) -> int:
    """Blocks for an explicit token count, or for a fraction of the device's memory.

    GPU: `fraction` of total memory minus what is already in use (weights, activations).
    CPU: `fraction` of the RAM available now.
    """
    if kv_cache_tokens is not None:
        return max(1, -(-kv_cache_tokens // spec.block_size))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * (memory_fraction or GPU_DEFAULT_FRACTION) - (total - free)
    else:
        budget = available_cpu_memory() * (memory_fraction or CPU_DEFAULT_FRACTION)
    blocks = int(budget // spec.bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory_fraction leaves no room for a KV block ({spec.bytes_per_block} bytes)"
        )
    return blocks
