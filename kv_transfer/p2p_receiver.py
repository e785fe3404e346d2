"""Receiving KV frames over two-rank process groups (transports `nccl` and `gloo`).

One thread accepts pairs (a sender announcing itself in the store) and runs the deadline clock;
one thread per pair receives frames in order: it waits on the pair's header socket for the next
batch of headers, then receives the payloads they announce over the group in one recv, straight
into device memory. It posts the next batch's recv (when its headers are in) before it writes a
batch into the cache, so the link stays busy while the host checks and writes. On the GPU a pair
thread posts recvs on a CUDA stream of its own and writes on another, so the model's stream never
waits on a recv and a write never holds back the next recv.
Every frame is checked and written by the shared `TransferInbox`. A frame for an unknown
transfer or with a wrong token is still received (the stream must stay in step) and then
dropped; a malformed header ends that pair.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdmesh.kv_transfer.base import KVReceiver
from pdmesh.kv_transfer.frame import (
    HEADER_NBYTES,
    MAX_FRAME_PAYLOAD,
    FrameHeader,
    MalformedFrame,
    alike_but_layer,
    peek,
)
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.inbox import TransferInbox
from pdmesh.kv_transfer.p2p_pairs import (
    BATCH_BYTES,
    GIL_SWITCH_S,
    MAX_BATCH_FRAMES,
    RECV_DEPTH,
    RENDEZVOUS_TIMEOUT,
    HeaderInbox,
    announced_pairs,
    host_port,
    pair_group,
    serve_store,
)
from pdmesh.logger import get_logger

log = get_logger(__name__)
TICK_S = 0.05
IDLE_POLL_MS = 50  # an idle pair thread looks at the stop flag this often


@dataclass
class _Posted:
    """One batch whose recv is posted: its raw headers, what was peeked of each, the buffer."""

    headers: list[bytes]
    peeked: list[tuple[int, int]]  # each header's (layer, payload bytes)
    payload: torch.Tensor
    work: Any
    posted_at: float  # time.monotonic()


class P2PReceiver(KVReceiver):
    backend = "gloo"

    def __init__(self, cache: torch.Tensor, geometry: PageGeometry, bind: str) -> None:
        if cache.is_cuda != (self.backend == "nccl"):
            raise ValueError(
                f"the {self.backend} KV transport needs a cache on "
                f"{'the GPU' if self.backend == 'nccl' else 'the CPU'}, got {cache.device}"
            )
        # As on the sending side (p2p_sender.py): a pair thread waiting for the GIL behind a
        # thread running Python would hold the next recv back by up to the switch interval.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        super().__init__(TransferInbox(cache, geometry))
        self._store = serve_store(bind)
        self._endpoint = f"tcp://{host_port(bind)[0]}:{self._store.port}"
        self._stop = threading.Event()
        self._seen = 0
        threading.Thread(target=self._accept, name="kv-p2p-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def close(self) -> None:
        # Pair threads blocked in recv end with the process (daemon threads).
        self._stop.set()
        self.inbox.close("the KV receiver closed")

    def _accept(self) -> None:
        while not self._stop.wait(TICK_S):
            self.inbox.expire()
            try:
                fresh = announced_pairs(self._store, self._seen)
            except Exception as e:
                log.warning("KV rendezvous store: %s", e)
                continue
            for pair_id in fresh:
                self._seen += 1
                threading.Thread(
                    target=self._serve_pair, args=(pair_id,), name=f"kv-p2p-{pair_id}", daemon=True
                ).start()

    def _serve_pair(self, pair_id: str) -> None:
        host, port = host_port(self._endpoint)
        inbox: HeaderInbox | None = None
        try:
            # A client of its own: its waits must not hold up the accept thread's store calls.
            client = dist.TCPStore(host, port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
            inbox = HeaderInbox(client, pair_id, host)
            group = pair_group(client, pair_id, rank=1, backend=self.backend)
            self._receive_frames(inbox, group)
        except Exception as e:
            if not self._stop.is_set():
                log.warning("KV pair %s closed: %s", pair_id, e)
        finally:
            if inbox is not None:
                inbox.close()

    def _receive_frames(self, inbox: HeaderInbox, group: dist.ProcessGroup) -> None:
        device = self.cache.device
        cuda = device.type == "cuda"
        # None on the CPU: torch.cuda.stream(None) changes nothing.
        recvs = torch.cuda.Stream(device) if cuda else None
        writes = torch.cuda.Stream(device) if cuda else None
        if recvs is not None:  # this thread's own current stream: its recvs go there
            torch.cuda.set_stream(recvs)
        posted: deque[_Posted] = deque()
        while not self._stop.is_set():
            raw = inbox.next(0 if posted else IDLE_POLL_MS)
            if raw is not None:
                posted.append(self._post_batch(raw, group, device))
                if len(posted) < RECV_DEPTH:
                    continue  # the next batch's headers may be in already: post its recv first
            if posted:
                with torch.cuda.stream(writes):
                    self._write_batch(posted.popleft())

    def _post_batch(self, raw: bytes, group: dist.ProcessGroup, device: torch.device) -> _Posted:
        """A batch's headers checked as far as its one recv needs (length, magic, version,
        sizes: each ~25 µs of Python counts before the first byte can move), and the recv
        posted. Headers that do not add up end the pair (its stream would be out of step)."""
        count, rest = divmod(len(raw), HEADER_NBYTES)
        if rest or not 0 < count <= MAX_BATCH_FRAMES:
            self.inbox.deliver(raw, None)  # counted as malformed
            raise MalformedFrame(f"a batch of {len(raw)} header bytes")
        headers = [raw[i * HEADER_NBYTES : (i + 1) * HEADER_NBYTES] for i in range(count)]
        peeked = []
        for header in headers:
            try:
                peeked.append(peek(header))
            except MalformedFrame:
                self.inbox.deliver(header, None)
                raise
        sizes = [size for _, size in peeked]
        if max(sizes) > MAX_FRAME_PAYLOAD or sum(sizes) > BATCH_BYTES:
            self.inbox.deliver(headers[0], None)
            raise MalformedFrame(f"a batch announces {sum(sizes)} bytes, over the limit")
        payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        posted_at = time.monotonic()
        work = group.recv([payload], 0, 0)
        return _Posted(headers, peeked, payload, work, posted_at)

    def _write_batch(self, batch: _Posted) -> None:
        """Each run of frames checked and written (on the GPU: queued on the current stream,
        after the recv)."""
        batch.work.wait()  # NCCL: the current stream waits for the recv; gloo: the host does
        if batch.payload.is_cuda:  # written on this stream, allocated on the recvs' one
            batch.payload.record_stream(torch.cuda.current_stream(batch.payload.device))
        offset = 0
        for first, layers in _runs(batch.headers, batch.peeked):
            header = FrameHeader.unpack(batch.headers[first])  # peeked: it parses
            size = header.payload_nbytes * layers
            part = batch.payload[offset : offset + size]
            self.inbox.deliver(header, part, layers, since=batch.posted_at)
            offset += size


def _runs(raw: list[bytes], peeked: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first index, count) of runs of frames alike but for consecutive layers: a prompt's
    layers pushed together are written into the cache with one copy, not one per layer."""
    runs: list[tuple[int, int]] = []
    for i, (layer, _) in enumerate(peeked):
        if runs:
            first, count = runs[-1]
            if layer == peeked[first][0] + count and alike_but_layer(raw[first], raw[i]):
                runs[-1] = (first, count + 1)
                continue
        runs.append((i, 1))
    return runs
