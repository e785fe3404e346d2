"""Sender-side staging shared by byte-stream transports: check one layer push and cut it into
frames whose payloads are contiguous CPU buffers, ready to be written by a background thread.

The copy is what lets `send_layer` return at once: the caller's k and v may be views into a cache
that the next layer's compute reuses. On CUDA the device-to-host copy goes into pinned memory
asynchronously on the current stream, and the writer waits on an event instead of the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.kv_transfer.base import SendHandle
from pdmesh.kv_transfer.geometry import PageGeometry


@dataclass(frozen=True)
class StagedFrame:
    header: bytes
    payload: torch.Tensor  # [2 (k, v), n, block_size, num_kv_heads, head_dim], contiguous, CPU
    ready: torch.cuda.Event | None  # set when the device-to-host copy is done; None on CPU

    @property
    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def payload_bytes(self) -> memoryview:
        """The payload as one flat byte buffer, without copying (keeps the tensor alive)."""
        return memoryview(self.payload.view(-1).view(torch.uint8).numpy())


def blocks_per_frame(geometry: PageGeometry, max_frame_bytes: int) -> int:
    """How many blocks fit one frame; ValueError when not even one does."""
    per_frame = max_frame_bytes // geometry.bytes_per_block
    if per_frame < 1:
        raise ValueError(
            f"one block of K and V is {geometry.bytes_per_block} bytes, above the frame limit of "
            f"{max_frame_bytes} bytes; raise max_frame_bytes or use smaller blocks"
        )
    return per_frame


def stage_layer(
    geometry: PageGeometry,
    handle: SendHandle,
    layer: int,
    first_block: int,
    k: torch.Tensor,
    v: torch.Tensor,
    max_frame_bytes: int,
) -> list[StagedFrame]:
    """k, v: [n, block_size, num_kv_heads, head_dim] -> frames of at most `max_frame_bytes`."""
    expected = geometry.page_shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or tuple(t.shape[1:]) != expected or t.shape[0] < 1:
            raise ValueError(
                f"{name} of shape {list(t.shape)} is not [n >= 1, {', '.join(map(str, expected))}]"
            )
        if t.dtype != geometry.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, the sender's geometry {geometry.dtype}")
    if k.shape != v.shape or k.device != v.device:
        raise ValueError(f"k {list(k.shape)} on {k.device} and v {list(v.shape)} on {v.device}")
    layers = handle.local_layers(geometry)
    if layer not in layers:
        raise ValueError(f"layer {layer} outside the transfer's [{layers.start}, {layers.stop})")
    n = k.shape[0]
    if first_block < 0 or first_block + n > handle.num_blocks:
        raise ValueError(
            f"blocks [{first_block}, {first_block + n}) outside the transfer's "
            f"{handle.num_blocks} blocks"
        )

    # Only the heads the receiver holds travel: [lo, hi) of this rank's local heads.
    lo = handle.head_start - geometry.head_start
    hi = lo + handle.num_heads
    if lo != 0 or hi != geometry.num_kv_heads:
        k, v = k[:, :, lo:hi], v[:, :, lo:hi]
    if lo < 0 or k.shape[2] != handle.num_heads:  # never let a copy broadcast one head into two
        raise ValueError(f"{handle!r} carries heads outside the sender's [{lo}, {hi})")
    shape = (geometry.block_size, handle.num_heads, geometry.head_dim)
    step = blocks_per_frame(geometry, max_frame_bytes)
    on_cuda = k.is_cuda
    frames = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        payload = torch.empty((2, stop - start, *shape), dtype=geometry.dtype, pin_memory=on_cuda)
        payload[0].copy_(k[start:stop], non_blocking=on_cuda)
        payload[1].copy_(v[start:stop], non_blocking=on_cuda)
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(k.device))
        header = handle.header(geometry, layer, first_block + start, stop - start)
        frames.append(StagedFrame(header.pack(), payload, ready))
    return frames
