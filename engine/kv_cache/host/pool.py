"""One rank's host-memory KV tier: slots in host memory (pinned on GPUs) for the KV of blocks the
device cache evicted, and the copies between them and the device cache.

Every rank holds a pool of the same number of slots, each slot the KV of one block for the
layers and heads this rank's cache holds; rank 0's index (engine/kv_cache/host/index.py) decides
what goes where, and each step carries its copies to every rank (engine/executor/step_codec.py).
`copy` runs them before the step's forward. On a GPU they are queued without a host sync (pinned
memory): the host goes on building the next step meanwhile. Offloads run on the compute stream,
loads on a stream of their own, chunk by chunk and pipelined (device-to-host and host-to-device
copies use different copy engines): a load chunk's slots are staged on the device at once, and
scattered into its blocks once the offloads that read those blocks' old KV are done. Loads a
sequence of the step reads finish before the forward; loads no sequence of the step reads
(`overlap`: their request sits the step out, see Scheduler) run beside it, and the next step's work
waits for them. On the CPU the copies run as they are called: offloads, then loads.
"""

from __future__ import annotations

import time

import torch

from pdmesh.engine.kv_cache.paged import KVCacheSpec
from pdmesh.engine.parallel.comm import host_to_device
from pdmesh.kv_transfer.connector import control_message

# Blocks staged on the device at once: bounds the copies' scratch memory (64 blocks of the
# Llama-3.1-8B shape: 128 MiB) whatever a step moves.
CHUNK = 64


@control_message
class OffloadNow:
    """Rank 0 asks a follower to copy these blocks to its host pool now (`offload_now`)."""

    pairs: tuple[int, ...]  # (device block, slot), flat


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
        self._side: torch.cuda.Stream | None = None  # loads beside a forward (GPU)
        self._loading: torch.cuda.Event | None = None  # the last of those, until waited for

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy(
        self, cache: torch.Tensor, offloads: list[int], loads: list[int], overlap: bool = False
    ) -> None:
        """Called before every step's forward. cache: [layers, 2, blocks, block_size, kv_heads,
        head_dim], this rank's KV cache. offloads: (device block, slot) pairs, flat: each
        block's KV into its slot; then loads: (slot, device block) pairs, flat: each slot's KV
        into its block, beside the forward with `overlap` (on a GPU)."""
        if self._loading is not None:  # the last step's loads: before anything of this one
            torch.cuda.current_stream().wait_event(self._loading)
            self._loading = None
        if not (offloads or loads):
            return
        start = self._start(cache.device)
        side = self._side_stream(cache.device) if loads else None
        if side is None:
            self._offload(cache, offloads)
            self._load(cache, loads)
            self._stop(start, None)
            return
        end = self._pipelined(cache, offloads, loads, side)
        if overlap:
            self._loading = end
        else:
            torch.cuda.current_stream().wait_event(end)  # the forward reads the loaded blocks
        self._stop(start, end if overlap else None)

    def _pipelined(
        self, cache: torch.Tensor, offloads: list[int], loads: list[int], side: torch.cuda.Stream
    ) -> torch.cuda.Event:
        """Offload chunks on the compute stream and load chunks on `side`, queued interleaved so
        both copy engines get work at once; each load chunk's scatter waits for the offload
        chunks that read the blocks it overwrites. Returns the event after every copy (on
        `side`)."""
        # The steps before: their reads and writes of the blocks and slots touched here.
        side.wait_stream(torch.cuda.current_stream())
        # Device block -> the offload chunk that reads its old KV (each block offloaded once).
        chunk_of = {b: i // (2 * CHUNK) for i, b in enumerate(offloads) if i % 2 == 0}
        num_offload_chunks = -(-len(offloads) // (2 * CHUNK))
        done: list[torch.cuda.Event] = []  # one per offload chunk queued so far

        def offload_upto(n: int) -> None:
            while len(done) < min(n, num_offload_chunks):
                at = len(done) * 2 * CHUNK
                self._offload(cache, offloads[at : at + 2 * CHUNK])
                done.append(torch.cuda.Event())
                done[-1].record()

        for j, at in enumerate(range(0, len(loads), 2 * CHUNK)):
            chunk = loads[at : at + 2 * CHUNK]
            needs = [chunk_of[b] for b in chunk[1::2] if b in chunk_of]
            offload_upto(max([j, *needs]) + 1)
            with torch.cuda.stream(side):
                staged = self._stage(cache, chunk[0::2])
                if needs:
                    side.wait_event(done[max(needs)])
                blocks = host_to_device(torch.tensor(chunk[1::2]), cache.device)
                cache[:, :, blocks] = staged.movedim(0, 2)
        offload_upto(num_offload_chunks)
        end = torch.cuda.Event(enable_timing=True)
        if done:
            side.wait_event(done[-1])  # so that `end` closes the offloads too
        end.record(side)
        return end

    @property
    def loading(self) -> bool:
        """Loads run beside a step that the next step has not waited for yet (GPU)."""
        return self._loading is not None

    def offload_now(self, cache: torch.Tensor, offloads: list[int]) -> None:
        """`copy`'s offloads, done on return (on a GPU the host waits for the stream): for
        blocks a KV receiver, not a step, writes next. Loads still running beside a step are
        waited for too: a block one writes into may have been freed and reserved since."""
        if self._loading is not None:
            self._loading.synchronize()
        if not offloads:
            return
        start = self._start(cache.device)
        self._offload(cache, offloads)
        self._stop(start, None)
        if cache.is_cuda:
            torch.cuda.current_stream(cache.device).synchronize()

    def _offload(self, cache: torch.Tensor, offloads: list[int]) -> None:
        for at in range(0, len(offloads), 2 * CHUNK):
            chunk = offloads[at : at + 2 * CHUNK]
            blocks = host_to_device(torch.tensor(chunk[0::2]), cache.device)
            staged = cache[:, :, blocks].movedim(2, 0).contiguous()  # [C, layers, 2, ...]
            for i, slot in enumerate(chunk[1::2]):
                self.data[slot].copy_(staged[i], non_blocking=True)

    def _load(self, cache: torch.Tensor, loads: list[int]) -> None:
        for at in range(0, len(loads), 2 * CHUNK):
            chunk = loads[at : at + 2 * CHUNK]
            staged = self._stage(cache, chunk[0::2])
            blocks = host_to_device(torch.tensor(chunk[1::2]), cache.device)
            cache[:, :, blocks] = staged.movedim(0, 2)

    def _stage(self, cache: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The slots' KV on the cache's device: [len(slots), layers, 2, block_size, ...]."""
        shape = (len(slots), *self.data.shape[1:])
        staged = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        for i, slot in enumerate(slots):
            staged[i].copy_(self.data[slot], non_blocking=True)
        return staged

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None  # copies on the CPU run as they are called
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _start(self, device: torch.device) -> float | torch.cuda.Event:
        if device.type != "cuda":
            return time.perf_counter()
        self._fold()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _stop(self, start: float | torch.cuda.Event, end: torch.cuda.Event | None) -> None:
        """end: the event that ends the copies when they end on the side stream."""
        if isinstance(start, float):
            self.seconds += time.perf_counter() - start
            return
        if end is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._timed.append((start, end))

    def _fold(self) -> None:
        """Add the copies that have finished on the device to `seconds`."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.pop(0)
            self.seconds += start.elapsed_time(end) / 1000
