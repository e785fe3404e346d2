"""A weight read into the GPU's L2 cache while the kernels before its projection run.

In a small decode step the kernels between two projections (rotary, the KV store, decode
attention) read little and leave HBM idle; the next projection's weight, read beside them on a
second stream, is then in the L2 when the projection reads it. Only inside CUDA graph capture
(the decode steps; the branch becomes part of the graph) and only for steps of at most
PDMESH_L2_READ_AHEAD rows: in larger steps the attention itself streams the KV cache.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pdmesh import envs
from pdmesh.kernels import read_into_l2


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def wanted(weight: torch.Tensor, rows: int) -> bool:
    """Whether `read_ahead(weight, rows)` reads the weight ahead."""
    return (
        weight.is_cuda
        and rows <= envs.l2_read_ahead_rows()
        and torch.cuda.is_current_stream_capturing()
    )


@contextmanager
def read_ahead(weight: torch.Tensor, rows: int) -> Iterator[None]:
    """Reads `weight` into the L2 beside the kernels launched inside the block (which must not
    write it); the stream waits for that read when the block ends. rows: the step's tokens."""
    if not wanted(weight, rows):
        yield
        return
    main = torch.cuda.current_stream(weight.device)
    side = _side_stream(weight.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        read_into_l2(weight)
    try:
        yield
    finally:
        main.wait_stream(side)
