"""Sending KV frames over two-rank process groups (transports `nccl` and `gloo`).

`send_layer` builds the frame on the tensors' device (the head slice the receiver holds, K and V
side by side), puts its header in the receiver's store and posts the payload's send, which runs
asynchronously: on the GPU the bytes go device to device, never through host memory. `finish`
waits for every send of the transfer (with a timeout): then the receiver has the bytes; it checks
and writes them itself and resolves its own future.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.kv_transfer.base import (
    KVSender,
    PageGeometry,
    SendCounters,
    SenderStats,
    SendHandle,
    TransferError,
    TransferStats,
    handle_heads,
)
from pdmesh.kv_transfer.frame import DTYPE_CODES, FrameHeader, payload_nbytes
from pdmesh.kv_transfer.p2p_pairs import (
    FRAME_QUEUE,
    announce_pair,
    join_store,
    pair_group,
    pair_store,
)
from pdmesh.logger import get_logger

log = get_logger(__name__)
POLL_S = 0.001


@dataclass
class _Pair:
    group: Any  # the two-rank process group
    headers: Any  # the pair's store, where its FRAME_QUEUE is
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handle(SendHandle):
    def __init__(
        self,
        pair: Any,
        endpoint: str,
        transfer_id: str,
        token: bytes,
        num_blocks: int,
        heads: tuple[int, int],
    ) -> None:
        super().__init__(endpoint, transfer_id, token, num_blocks, *heads)
        self.pair: _Pair = pair
        self.works: list[tuple[Any, torch.Tensor]] = []  # (work, payload) in flight
        self.bytes = 0
        self.frames = 0
        self.first_sent_at: float | None = None
        self.ended = False


class P2PSender(KVSender):
    backend = "gloo"

    def __init__(self, geometry: PageGeometry) -> None:
        self.geometry = geometry
        self._pairs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._counts = SendCounters()

    def _pair(self, endpoint: str) -> Any:
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is None:
                store = join_store(endpoint)
                pair_id = announce_pair(store)
                group = pair_group(store, pair_id, rank=0, backend=self.backend)
                pair = self._pairs[endpoint] = _Pair(group, pair_store(store, pair_id))
            return pair

    def start(
        self,
        endpoint: str,
        spec_id: str,
        token: bytes,
        num_blocks: int,
        heads: tuple[int, int] | None = None,
    ) -> SendHandle:
        span = handle_heads(self.geometry, heads)
        return _Handle(self._pair(endpoint), endpoint, spec_id, token, num_blocks, span)

    def send_layer(
        self, handle: SendHandle, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        h = self._own(handle)
        geo = self.geometry
        n = k.shape[0]
        if h.ended:
            raise ValueError(f"{h!r}: send_layer after finish() or abort()")
        if k.shape != v.shape or tuple(k.shape[1:]) != (
            geo.block_size,
            geo.num_kv_heads,
            geo.head_dim,
        ):
            raise ValueError(f"k {list(k.shape)} / v {list(v.shape)} do not fit {geo}")
        if not 0 <= layer < geo.num_layers or first_block < 0 or first_block + n > h.num_blocks:
            raise ValueError(
                f"layer {layer}, blocks [{first_block}, {first_block + n}) out of range"
            )
        lo = h.head_start - geo.head_start
        payload = torch.stack((k[:, :, lo : lo + h.num_heads], v[:, :, lo : lo + h.num_heads]))
        payload = payload.contiguous().view(-1).view(torch.uint8)
        nbytes = payload_nbytes(n, geo.block_size, h.num_heads, geo.head_dim, geo.dtype.itemsize)
        header = FrameHeader(
            transfer_id=h.raw_id,
            token=h.token,
            layer=layer,
            first_block=first_block,
            num_blocks=n,
            head_start=h.head_start,
            num_heads=h.num_heads,
            block_size=geo.block_size,
            head_dim=geo.head_dim,
            dtype_code=DTYPE_CODES[geo.dtype],
            payload_nbytes=nbytes,
        ).pack()
        pair = h.pair
        try:
            with pair.lock:  # headers and sends in one order
                pair.headers.queue_push(FRAME_QUEUE, header)
                work = pair.group.send([payload], 1, 0)
        except Exception as e:
            raise TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {e}") from None
        h.works.append((work, payload))  # the payload lives until its send is done
        h.bytes += nbytes
        h.frames += 1
        if h.first_sent_at is None:
            h.first_sent_at = time.monotonic()

    def finish(self, handle: SendHandle, timeout: float) -> TransferStats:
        h = self._own(handle)
        if h.ended:
            raise ValueError(f"{h!r}: finish() or abort() was already called")
        h.ended = True
        deadline = time.monotonic() + timeout
        try:
            for work, _ in h.works:
                self._wait(work, deadline, h, timeout)
        except TransferError:
            self._broken(h)
            raise
        except Exception as e:
            self._broken(h)
            raise TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {e}") from None
        seconds = time.monotonic() - (h.first_sent_at or time.monotonic())
        h.works.clear()
        with self._lock:
            self._counts.bytes_sent += h.bytes
            self._counts.frames_sent += h.frames
            self._counts.transfers += 1
            self._counts.seconds_sending += seconds
        return TransferStats(bytes=h.bytes, seconds=seconds, frames=h.frames)

    def _wait(self, work: Any, deadline: float, h: _Handle, timeout: float) -> None:
        """Until one send is done; TransferError past the deadline, or the send's own error."""
        stuck = TransferError(
            f"transfer {h.transfer_id} to {h.endpoint}: sends not done within {timeout:g} s; "
            "is the receiver there?"
        )
        if self.backend == "gloo":  # gloo's work completes inside wait(), which takes a timeout
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                raise stuck if "Timed out" in str(e) else e from None
            return
        while not work.is_completed():  # NCCL: completion is a CUDA event, polled
            if time.monotonic() > deadline:
                raise stuck
            time.sleep(POLL_S)
        work.wait()  # raises the send's error, if it failed

    def _broken(self, h: _Handle) -> None:
        """A failed or stuck send poisons its pair: the next transfer to that receiver builds a
        new one."""
        with self._lock:
            self._counts.transfers_failed += 1
            if self._pairs.get(h.endpoint) is h.pair:
                del self._pairs[h.endpoint]
        abort = getattr(h.pair.group, "abort", None)
        if callable(abort):
            try:
                abort()
            except Exception as e:
                log.debug("aborting a KV pair group: %s", e)

    def abort(self, handle: SendHandle) -> None:
        self._own(handle).ended = True

    @property
    def stats(self) -> SenderStats:
        with self._lock:
            return self._counts.snapshot()

    def close(self) -> None:
        with self._lock:
            self._pairs.clear()

    def _own(self, handle: SendHandle) -> _Handle:
        if not isinstance(handle, _Handle):
            raise ValueError(f"{handle!r} does not belong to this sender")
        return handle
