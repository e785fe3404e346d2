"""Sending KV frames over two-rank process groups (transports `nccl` and `gloo`).

`send_layer` copies the frame's payload on the tensors' device (the head slice the receiver
holds, K and V side by side) and queues it; `send_blocks` gathers it straight from the cache.
Neither waits on the network: a thread per pair (p2p_poster.py) posts their frames in order, in
batches, device to device on the GPU (never through host memory); `send_layers`' large runs are
posted on the caller's thread instead. `finish` waits for every send of the transfer (with a
timeout): then the receiver has the bytes; it checks and writes them itself and resolves its own
future.
"""

from __future__ import annotations

import datetime
import functools
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pdmesh.kv_transfer.base import Handles, KVSender, SendHandle, TransferError
from pdmesh.kv_transfer.frame import payload_nbytes
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.p2p_pairs import (
    BATCH_BYTES,
    GIL_SWITCH_S,
    HeaderOutbox,
    announce_pair,
    host_port,
    join_store,
    pair_group,
)
from pdmesh.kv_transfer.p2p_poster import Frame, Pair, Send
from pdmesh.kv_transfer.pages import gather_blocks
from pdmesh.kv_transfer.stats import TransferStats
from pdmesh.logger import get_logger

log = get_logger(__name__)
POLL_S = 0.0002  # NCCL send completion, polled: a prefill reply waits on it


@dataclass(eq=False, repr=False)
class _Handle(SendHandle):
    pair: Pair = field(init=False)
    frames: list[Frame] = field(default_factory=list, init=False)  # queued, in order


def _stuck(h: _Handle, timeout: float) -> TransferError:
    return TransferError(
        f"transfer {h.transfer_id} to {h.endpoint}: sends not done within {timeout:g} s; "
        "is the receiver there?"
    )


class P2PSender(KVSender):
    Handle = _Handle
    backend = "gloo"

    def __init__(self, geometry: PageGeometry) -> None:
        super().__init__(geometry)
        # The pair threads post while the caller's thread runs a forward pass in Python, which
        # holds the GIL between kernel launches: by default a waiting thread gets it after 5 ms,
        # which would hold every batch back by as much. Half a millisecond keeps them flowing.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._pairs: dict[str, Pair] = {}

    def _pair(self, endpoint: str) -> Pair:
        with self._lock:
            pair = self._pairs.get(endpoint)
            if pair is None or pair.broken is not None:
                store = join_store(endpoint)
                pair_id = announce_pair(store)
                group = pair_group(store, pair_id, rank=0, backend=self.backend)
                headers = HeaderOutbox(store, pair_id, host_port(endpoint)[0])
                pair = Pair(group, headers, f"kv-send-{pair_id}")
                self._pairs[endpoint] = pair
            return pair

    def _open(self, handle: _Handle) -> None:
        handle.pair = self._pair(handle.endpoint)

    def send_layer(
        self, handle: SendHandle, layer: int, first_block: int, k: Tensor, v: Tensor
    ) -> None:
        geo = self.geometry
        n = k.shape[0]
        h = self._checked(handle, "send_layer", layer, first_block, n)
        if k.shape != v.shape or tuple(k.shape[1:]) != geo.page_shape:
            raise ValueError(f"k {list(k.shape)} / v {list(v.shape)} do not fit {geo}")
        lo = h.head_start - geo.head_start
        payload = torch.stack((k[:, :, lo : lo + h.num_heads], v[:, :, lo : lo + h.num_heads]))
        self._queue(h, layer, first_block, n, payload)

    def send_blocks(
        self, handles: Handles, layer: int, first_block: int, pages: Tensor, block_ids: Tensor
    ) -> None:
        """Each handle's heads gathered from the cache straight into its frame (one copy)."""
        geo = self.geometry
        geo.check_pages(pages, (2,), "pages")
        n = block_ids.numel()
        for handle in handles:
            if layer not in handle.local_layers(geo):
                continue
            h = self._checked(handle, "send_blocks", layer, first_block, n)
            lo = h.head_start - geo.head_start
            payload = gather_blocks(pages[:, :, :, lo : lo + h.num_heads], 1, block_ids)
            self._queue(h, layer, first_block, n, payload)

    def send_layers(
        self, handles: Handles, first_block: int, cache: Tensor, block_ids: Tensor
    ) -> None:
        """Each handle's heads of every layer, gathered into one buffer (at most two batches'
        worth at a time: one copy, few host calls, which cost ~25 µs each on a busy host) and
        queued as one frame per batch, each carrying its layers' headers. Two batches at least,
        so the receiver writes the first while the second moves. The copy is made once the
        headers are pushed (`Frame.fill`), so the receiver posts its receive meanwhile."""
        geo = self.geometry
        geo.check_pages(cache, (geo.num_layers, 2), "cache")
        n = block_ids.numel()
        for handle in handles:
            layers = handle.local_layers(geo)
            h = self._checked(handle, "send_layers", layers.start, first_block, n)
            lo = h.head_start - geo.head_start
            heads = cache[..., lo : lo + h.num_heads, :]
            layer_bytes = payload_nbytes(
                n, geo.block_size, h.num_heads, geo.head_dim, geo.dtype.itemsize
            )
            step = max(1, min(BATCH_BYTES // layer_bytes, -(-len(layers) // 2)))
            for start in range(layers.start, layers.stop, 2 * step):
                stop = min(start + 2 * step, layers.stop)
                part = heads[start:stop]
                shape = (stop - start, 2, n, *part.shape[3:])
                gathered = torch.empty(shape, dtype=part.dtype, device=part.device)
                fill = functools.partial(_gather_into, part, block_ids, gathered, _recorded(part))
                flat = gathered.view(-1).view(torch.uint8)
                packed = h.header(geo, start, first_block, n).pack_layers(stop - start)
                frames = [
                    Frame(
                        b"".join(packed[i : i + step]),
                        flat[i * layer_bytes : (i + step) * layer_bytes],
                        None,
                        fill,
                    )
                    for i in range(0, stop - start, step)
                ]
                self._put(h, frames)

    def _checked(
        self, handle: SendHandle, op: str, layer: int, first_block: int, n: int
    ) -> _Handle:
        h = self._own(handle)
        if h.ended:
            raise ValueError(f"{h!r}: {op} after finish() or abort()")
        if layer not in h.local_layers(self.geometry) or not 0 <= first_block <= h.num_blocks - n:
            raise ValueError(
                f"layer {layer}, blocks [{first_block}, {first_block + n}) out of range"
            )
        return h

    def _queue(self, h: _Handle, layer: int, first_block: int, n: int, kv: torch.Tensor) -> None:
        """Queue one frame; `kv` ([2, n, block_size, heads, head_dim]) is this frame's own."""
        header = h.header(self.geometry, layer, first_block, n).pack()
        self._put(h, [Frame(header, kv.contiguous().view(-1).view(torch.uint8), _recorded(kv))])

    def _put(self, h: _Handle, frames: list[Frame]) -> None:
        nbytes = sum(f.payload.numel() for f in frames)  # before posting joins them
        try:
            h.pair.put(frames)
        except TransferError as e:
            raise TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {e}") from None
        h.frames += frames
        h.nbytes += nbytes
        if h.first_sent_at is None:
            h.first_sent_at = time.monotonic()

    def done(self, handle: SendHandle) -> bool:
        h = self._own(handle)
        for frame in h.frames:
            sent = frame.sent
            if not frame.posted.is_set() or frame.error is not None or sent is None:
                return False
            if not sent.done and not (self.backend == "nccl" and sent.work.is_completed()):
                return False
        return not h.ended

    def finish(self, handle: SendHandle, timeout: float) -> TransferStats:
        h = self._own(handle)
        if h.ended:
            raise ValueError(f"{h!r}: finish() or abort() was already called")
        h.ended = True
        deadline = time.monotonic() + timeout
        try:
            for frame in h.frames:
                self._wait(frame, deadline, h, timeout)
                assert frame.sent is not None
                self._wait_sent(frame.sent, deadline, h, timeout)
        except TransferError:
            self._broken(h)
            raise
        except Exception as e:
            self._broken(h)
            raise TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {e}") from None
        seconds = time.monotonic() - (h.first_sent_at or time.monotonic())
        frames = sum(f.count for f in h.frames)
        h.frames.clear()
        with self._lock:
            self._counts.bytes_sent += h.nbytes
            self._counts.frames_sent += frames
            self._counts.transfers += 1
            self._counts.seconds_sending += seconds
        return TransferStats(bytes=h.nbytes, seconds=seconds, frames=frames)

    def _wait(self, frame: Frame, deadline: float, h: _Handle, timeout: float) -> None:
        """Until the frame's send was posted; TransferError if that failed or took too long."""
        if not frame.posted.wait(max(0.0, deadline - time.monotonic())):
            raise _stuck(h, timeout)
        if frame.error is not None:
            raise TransferError(f"transfer {h.transfer_id} to {h.endpoint}: {frame.error}")

    def _wait_sent(self, sent: Send, deadline: float, h: _Handle, timeout: float) -> None:
        """Until one send is done; TransferError past the deadline, or the send's own error.
        Frames of several transfers may share a send, but a gloo send can be waited for only
        once: the first caller waits, the others wait for it."""
        if not sent.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _stuck(h, timeout)
        try:
            if sent.done:
                return
            if self.backend == "gloo":  # gloo's work completes inside wait(), with a timeout
                left = max(0.001, deadline - time.monotonic())
                try:
                    sent.work.wait(datetime.timedelta(seconds=left))
                except RuntimeError as e:
                    raise _stuck(h, timeout) if "Timed out" in str(e) else e from None
            else:
                while not sent.work.is_completed():  # NCCL: completion is a CUDA event, polled
                    if time.monotonic() > deadline:
                        raise _stuck(h, timeout)
                    time.sleep(POLL_S)
                sent.work.wait()  # raises the send's error, if it failed
            sent.done = True
        finally:
            sent.lock.release()

    def _broken(self, h: _Handle) -> None:
        """A failed or stuck send poisons its pair: the next transfer to that receiver builds a
        new one."""
        with self._lock:
            self._counts.transfers_failed += 1
            if self._pairs.get(h.endpoint) is h.pair:
                del self._pairs[h.endpoint]
        h.pair.close(f"transfer {h.transfer_id} failed")
        abort = getattr(h.pair.group, "abort", None)
        if callable(abort):
            try:
                abort()
            except Exception as e:
                log.debug("aborting a KV pair group: %s", e)

    def abort(self, handle: SendHandle) -> None:
        self._own(handle).ended = True

    def close(self) -> None:
        with self._lock:
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            pair.close("the KV sender is closed")

    def _own(self, handle: SendHandle) -> _Handle:
        if not isinstance(handle, _Handle):
            raise ValueError(f"{handle!r} does not belong to this sender")
        return handle


def _gather_into(
    part: Tensor, block_ids: Tensor, out: Tensor, after: torch.cuda.Event | None
) -> torch.cuda.Event | None:
    """`part`'s blocks gathered into `out` on the current stream, once `after` (the cache as
    the caller left it) has passed; an event after the copy (None on the CPU)."""
    if after is not None:
        torch.cuda.current_stream(out.device).wait_event(after)
    # `out` was made in the caller's forward pass (inference mode); the pair's thread may copy.
    with torch.inference_mode():
        gather_blocks(part, 2, block_ids, out=out)
    return _recorded(out)


def _recorded(t: torch.Tensor) -> torch.cuda.Event | None:
    """An event after the copy that made `t` (on the current stream); None on the CPU."""
    if not t.is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return ready
