"""One rank's host-memory KV tier: slots in host memory (pinned on GPUs) for the KV of blocks the
device cache evicted, and the copies between them and the device cache.

Every rank holds a pool of the same number of slots, each slot the KV of one block for the
layers and heads this rank's cache holds; rank 0's index (engine/host_index.py) decides what goes
where, and each step carries its copies to every rank (engine/step_codec.py). `copy` runs them
before the step's forward. On a GPU the copies are queued on the current stream without a host
sync (pinned memory): the host goes on building the next step while they run, and the forward
queued after them sees their result; they do not overlap that forward.
"""

from __future__ import annotations

import time

import torch

from pdmesh.engine.distributed import host_to_device
from pdmesh.engine.kv_cache import KVCacheSpec


def plan_slots(spec: KVCacheSpec, gib: float, num_ranks: int) -> int:
    """Slots for this rank's share (1 / `num_ranks`) of `gib` GiB of host memory."""
    slots = int(gib * 2**30 / num_ranks // spec.bytes_per_block)
    if slots < 1:
        raise ValueError(
            f"kv_offload_gib={gib} holds no KV block ({spec.bytes_per_block * num_ranks} bytes "
            "over the worker's ranks): raise it, or set 0 to turn the host tier off."
        )
    return slots


class HostPool:
    def __init__(self, spec: KVCacheSpec, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        # [slots, layers, 2 (k, v), block_size, kv_heads, head_dim]: a slot is contiguous, so a
        # block moves in one copy.
        shape = (num_slots, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = torch.zeros(shape, dtype=spec.dtype, pin_memory=device.type == "cuda")
        self.seconds = 0.0  # spent copying, as far as measured (GPU: events read so far)
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy(self, cache: torch.Tensor, offloads: list[int], loads: list[int]) -> None:
        """cache: [layers, 2, blocks, block_size, kv_heads, head_dim], this rank's KV cache.
        offloads: (device block, slot) pairs, flat: each block's KV into its slot; then loads:
        (slot, device block) pairs, flat: each slot's KV into its block."""
        start = self._start(cache.device)
        if offloads:
            blocks = host_to_device(torch.tensor(offloads[0::2]), cache.device)
            staged = cache[:, :, blocks].movedim(2, 0).contiguous()  # [C, layers, 2, ...]
            for i, slot in enumerate(offloads[1::2]):
                self.data[slot].copy_(staged[i], non_blocking=True)
        if loads:
            slots = loads[0::2]
            staged = torch.empty(
                (len(slots), *self.data.shape[1:]), dtype=cache.dtype, device=cache.device
            )
            for i, slot in enumerate(slots):
                staged[i].copy_(self.data[slot], non_blocking=True)
            blocks = host_to_device(torch.tensor(loads[1::2]), cache.device)
            cache[:, :, blocks] = staged.movedim(0, 2)
        self._stop(start)

    def _start(self, device: torch.device) -> float | torch.cuda.Event:
        if device.type != "cuda":
            return time.perf_counter()
        self._fold()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _stop(self, start: float | torch.cuda.Event) -> None:
        if isinstance(start, float):
            self.seconds += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timed.append((start, end))

    def _fold(self) -> None:
        """Add the copies that have finished on the device to `seconds`."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.pop(0)
            self.seconds += start.elapsed_time(end) / 1000
