"""Facts about the device that the launch heuristics of every Triton kernel here depend on."""

from __future__ import annotations

import functools

import torch

# Under the Triton interpreter (CPU) there is no SM count; a small one makes the split heuristics
# choose several splits on the small shapes the tests use.
_INTERPRETER_SMS = 4


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a stand-in value off CUDA)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for tl.dot: without "ieee", fp32 operands are rounded to TF32 on the GPU
    (~1e-3 relative error), which would make fp32 results disagree with the references."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension is dense (every kernel here assumes stride 1 there)."""
    return x if x.stride(-1) == 1 else x.contiguous()
