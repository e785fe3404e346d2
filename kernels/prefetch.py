"""Reading a tensor ahead of its use, into the GPU's L2 cache (kernels/triton/l2_read.py)."""

from __future__ import annotations

import torch

from pdmesh.kernels.backend import pick


def read_into_l2(t: torch.Tensor) -> torch.Tensor:
    """Reads `t` (dense, a multiple of 4 bytes) once; on a GPU its lines are then in the L2 for
    the next kernel that reads it. Returns int32 words whose XOR is the XOR of t's 32-bit words
    (how they are split between the words returned is the implementation's)."""
    return pick("read_into_l2", t, read_into_l2_ref)(t)


def read_into_l2_ref(t: torch.Tensor) -> torch.Tensor:
    words = t.reshape(-1).view(torch.int32)
    while words.numel() > 1:  # fold halves: XOR has no reduction in torch
        half = words.numel() // 2
        folded = words[:half] ^ words[half : 2 * half]
        words = torch.cat([folded, words[2 * half :]]) if words.numel() % 2 else folded
    return words.clone()
