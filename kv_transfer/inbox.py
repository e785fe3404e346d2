"""Receiver-side bookkeeping shared by every transport: announced transfers, frame checks, writes
into the cache, head coverage, deadlines and counters.

A transport thread hands each message to `deliver` and calls `expire` now and then; control-plane
threads call `expect` and `cancel`. One lock covers the table *and* the writes, so once a transfer
has been removed (completed, expired, cancelled) no frame of it can still be half-way into the
cache: its blocks are safe to free or reuse.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import numpy as np
import torch

from pdmesh.kv_transfer.base import TransferError, TransferSpec
from pdmesh.kv_transfer.frame import (
    FrameHeader,
    MalformedFrame,
    Verdict,
    payload_nbytes,
)
from pdmesh.kv_transfer.geometry import PageGeometry, head_overlap
from pdmesh.kv_transfer.pages import scatter_blocks
from pdmesh.kv_transfer.stats import ReceiverStats, TransferStats
from pdmesh.logger import get_logger

log = get_logger(__name__)


@dataclass
class _Pending:
    spec: TransferSpec
    future: Future[TransferStats]
    deadline: float  # time.monotonic()
    block_index: torch.Tensor  # [num_blocks] int64 receiver block ids, on the cache's device
    index_ready: torch.cuda.Event | None  # block_index's copy to the GPU is done (None: CPU)
    cover_start: int  # global heads expected: spec range ∩ this rank's range
    # [L, num_blocks, cover_heads] bool: numpy, whose slicing and sums cost a microsecond where
    # torch's CPU ops cost tens on a busy host (a frame's write makes four of them).
    coverage: np.ndarray
    covered: int = 0  # True entries of `coverage`
    bytes: int = 0
    frames: int = 0
    first_frame_at: float | None = None
    # Why authentic frames of it were refused, when they can never fit (another KV dtype): said
    # when the transfer fails. The transfer is not failed at once: a refused frame never is.
    refused: str = ""


class TransferInbox:
    def __init__(self, cache: torch.Tensor, geometry: PageGeometry) -> None:
        self.num_blocks = geometry.check_cache(cache)
        self.cache = cache  # [L, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.geometry = geometry
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}  # raw transfer id -> state
        self._closed = False
        self._completed = 0
        self._failed = 0
        self._bytes = 0
        self._frames = 0
        self._seconds = 0.0
        self._dropped = dict.fromkeys(Verdict, 0)
        self._copies = torch.cuda.Stream(cache.device) if cache.is_cuda else None

    def _device_ids(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The receiver's block ids on the cache's device, and an event the writers wait for.
        On a GPU the copy is queued on a stream of its own from pinned memory: `expect` is often
        called from an event loop, and a copy from pageable memory would wait for whatever the
        device is running."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self._copies is None:
            return ids, None
        with torch.cuda.stream(self._copies):
            index = ids.pin_memory().to(self.cache.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copies)
        return index, ready

    # -- control plane ------------------------------------------------------------------------
    def expect(self, spec: TransferSpec, timeout: float) -> Future[TransferStats]:
        if not timeout > 0:
            raise ValueError(f"a transfer timeout must be positive seconds, got {timeout!r}")
        geo = self.geometry
        if max(spec.block_ids) >= self.num_blocks:
            raise ValueError(
                f"transfer {spec.transfer_id} names block {max(spec.block_ids)}, "
                f"this cache has {self.num_blocks} blocks"
            )
        lo, hi = head_overlap(spec.head_start, spec.num_heads, geo.head_start, geo.num_kv_heads)
        if lo >= hi:
            raise ValueError(
                f"transfer {spec.transfer_id} expects heads [{spec.head_start}, "
                f"{spec.head_start + spec.num_heads}), this rank holds [{geo.head_start}, "
                f"{geo.head_end})"
            )
        future: Future[TransferStats] = Future()
        index, ready = self._device_ids(spec.block_ids)
        pending = _Pending(
            spec=spec,
            future=future,
            deadline=time.monotonic() + timeout,
            block_index=index,
            index_ready=ready,
            cover_start=lo,
            coverage=np.zeros((geo.num_layers, spec.num_blocks, hi - lo), dtype=bool),
        )
        key = spec.raw_id
        with self._lock:
            if self._closed:
                raise TransferError("the KV receiver is closed")
            if key in self._pending:
                raise ValueError(f"transfer {spec.transfer_id} is already expected")
            self._pending[key] = pending
        # asyncio.wrap_future cancels this future when its awaiter is cancelled: forget the
        # transfer then, so the caller can free its blocks.
        future.add_done_callback(lambda f: self._forget_if_cancelled(key, f))
        return future

    def cancel(self, transfer_id: str) -> None:
        key = bytes.fromhex(transfer_id)
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is not None:
                self._failed += 1
        if pending is not None:
            error = f"transfer {transfer_id} was cancelled{pending.refused}"
            _fail(pending.future, TransferError(error))

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [key for key, p in self._pending.items() if p.deadline <= now]
            gone = [self._pending.pop(key) for key in expired]
            self._failed += len(gone)
        for pending in gone:
            missing = pending.coverage.size - pending.covered
            _fail(
                pending.future,
                TransferError(
                    f"transfer {pending.spec.transfer_id} timed out with {missing} of "
                    f"{pending.coverage.size} (layer, block, head) pages missing"
                    f"{pending.refused}"
                ),
            )

    def close(self, reason: str) -> None:
        with self._lock:
            self._closed = True
            gone = list(self._pending.values())
            self._pending.clear()
            self._failed += len(gone)
        for pending in gone:
            _fail(pending.future, TransferError(f"transfer {pending.spec.transfer_id}: {reason}"))

    @property
    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(
                transfers_completed=self._completed,
                transfers_failed=self._failed,
                bytes_received=self._bytes,
                frames_received=self._frames,
                dropped_unknown_transfer=self._dropped[Verdict.UNKNOWN_TRANSFER],
                dropped_bad_token=self._dropped[Verdict.BAD_TOKEN],
                dropped_bad_size=self._dropped[Verdict.BAD_SIZE],
                dropped_malformed=self._dropped[Verdict.MALFORMED],
                seconds_receiving=self._seconds,
            )

    # -- data plane ---------------------------------------------------------------------------
    def deliver(
        self,
        header_bytes: bytes | memoryview | FrameHeader,
        payload: memoryview | torch.Tensor | None,
        layers: int = 1,
        since: float | None = None,
    ) -> tuple[Verdict, FrameHeader | None]:
        """Check one message and write it. `payload` is None when the message had no second part
        (or extra parts); a tensor (flat uint8, possibly on the GPU) when the transport receives
        into device memory. Returns the verdict and the parsed header (None when malformed). A
        transport that parsed the header already passes it parsed, and one that posts receives
        ahead of writes passes `since`, when this payload's receive was posted (monotonic): a
        transfer's seconds then start there.

        layers > 1: the payloads of that many frames alike but for their layers (the header's
        layer and the ones after it), back to back, written at once."""
        try:
            header = (
                header_bytes
                if isinstance(header_bytes, FrameHeader)
                else FrameHeader.unpack(header_bytes)
            )
        except MalformedFrame:
            return self._drop(Verdict.MALFORMED), None
        if payload is None:
            return self._drop(Verdict.MALFORMED, layers), header
        arrived = time.monotonic() if since is None else since
        with self._lock:
            pending = self._pending.get(header.transfer_id)
            verdict = self._check(header, payload, pending, layers)
            if verdict is not Verdict.ACCEPTED or pending is None:
                self._dropped[verdict] += layers
                if pending is not None and verdict is Verdict.BAD_SIZE:
                    pending.refused = pending.refused or self._dtype_mismatch(header)
                return verdict, header
            try:
                self._write(header, payload, pending, arrived, layers)
            except Exception:  # a bug must not kill the transport thread
                log.exception("writing a KV frame of transfer %s failed", header.transfer_id.hex())
                self._dropped[Verdict.BAD_SIZE] += layers
                return Verdict.BAD_SIZE, header
            done = pending.covered == pending.coverage.size  # this frame ends the transfer
            if done:
                del self._pending[header.transfer_id]
                self._completed += 1
        if done:
            if self.cache.is_cuda:  # writes were queued on this thread's stream
                torch.cuda.current_stream(self.cache.device).synchronize()
            # From the first payload in hand (on a GPU: its receive posted) to the last block
            # written on the device.
            seconds = time.monotonic() - (pending.first_frame_at or arrived)
            with self._lock:
                self._seconds += seconds
            stats = TransferStats(bytes=pending.bytes, seconds=seconds, frames=pending.frames)
            with contextlib.suppress(InvalidStateError):  # cancelled by its owner meanwhile
                pending.future.set_result(stats)
        return Verdict.ACCEPTED, header

    def _dtype_mismatch(self, h: FrameHeader) -> str:
        """Why an authentic frame of another KV dtype can never fit; "" for any other."""
        ours = self.geometry.dtype
        if h.dtype == ours:
            return ""
        theirs = str(h.dtype or f"code {h.dtype_code}").removeprefix("torch.")
        return (
            f"; its frames carry KV of dtype {theirs}, this cache holds "
            f"{str(ours).removeprefix('torch.')}: both workers need the same kv_cache_dtype "
            "(and model dtype)"
        )

    def _check(
        self,
        h: FrameHeader,
        payload: memoryview | torch.Tensor,
        pending: _Pending | None,
        layers: int = 1,
    ) -> Verdict:
        if pending is None:
            return Verdict.UNKNOWN_TRANSFER
        if not hmac.compare_digest(h.token, pending.spec.token):
            return Verdict.BAD_TOKEN
        geo = self.geometry
        if (h.dtype, h.block_size, h.head_dim) != (geo.dtype, geo.block_size, geo.head_dim):
            return Verdict.BAD_SIZE
        # Frames name global layers: this rank holds geo.layers (a pipeline stage's range).
        if h.layer < geo.layer_start or not 1 <= layers <= geo.layers.stop - h.layer:
            return Verdict.BAD_SIZE
        if h.num_blocks == 0 or h.first_block + h.num_blocks > pending.spec.num_blocks:
            return Verdict.BAD_SIZE
        lo, hi = head_overlap(
            h.head_start, h.num_heads, pending.cover_start, pending.coverage.shape[2]
        )
        if h.num_heads == 0 or lo >= hi:
            return Verdict.BAD_SIZE
        expected = payload_nbytes(
            h.num_blocks, h.block_size, h.num_heads, h.head_dim, geo.dtype.itemsize
        )
        if h.payload_nbytes != expected or payload.nbytes != expected * layers:  # tensors too
            return Verdict.BAD_SIZE
        return Verdict.ACCEPTED

    def _write(
        self,
        h: FrameHeader,
        payload: memoryview | torch.Tensor,
        pending: _Pending,
        arrived: float,
        layers: int,
    ) -> None:
        geo = self.geometry
        if isinstance(payload, torch.Tensor):
            data = payload.view(torch.uint8).flatten()
        else:
            data = torch.frombuffer(payload, dtype=torch.uint8)
        if data.data_ptr() % geo.dtype.itemsize:  # small messages may sit unaligned in zmq's buffer
            data = data.clone()
        # src: [layers, 2 (k, v), n, block_size, frame heads, head_dim], zero-copy over the message
        src = data.view(geo.dtype).view(
            layers, 2, h.num_blocks, h.block_size, h.num_heads, h.head_dim
        )
        lo, hi = head_overlap(
            h.head_start, h.num_heads, pending.cover_start, pending.coverage.shape[2]
        )
        src = src[..., lo - h.head_start : hi - h.head_start, :]
        if self.cache.is_cuda:
            src = src.to(self.cache.device)
        # dst: [layers, 2, num_blocks, block_size, hi - lo, head_dim], a strided view
        first = h.layer - geo.layer_start
        end = first + layers
        dst = self.cache[first:end, :, :, :, lo - geo.head_start : hi - geo.head_start]
        if pending.index_ready is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(pending.index_ready)
        index = pending.block_index[h.first_block : h.first_block + h.num_blocks]
        scatter_blocks(dst, 2, index, src)

        cover = pending.coverage[
            first:end,
            h.first_block : h.first_block + h.num_blocks,
            lo - pending.cover_start : hi - pending.cover_start,
        ]
        pending.covered += cover.size - int(cover.sum())  # repeats do not count twice
        cover[...] = True
        pending.bytes += h.payload_nbytes * layers
        pending.frames += layers
        if pending.first_frame_at is None:
            pending.first_frame_at = arrived
        self._bytes += h.payload_nbytes * layers
        self._frames += layers

    def _drop(self, verdict: Verdict, frames: int = 1) -> Verdict:
        with self._lock:
            self._dropped[verdict] += frames
        return verdict

    def _forget_if_cancelled(self, key: bytes, future: Future[TransferStats]) -> None:
        if not future.cancelled():
            return
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and pending.future is future:
                del self._pending[key]
                self._failed += 1


def _fail(future: Future[TransferStats], error: TransferError) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled by its owner meanwhile
        future.set_exception(error)
