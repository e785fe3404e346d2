"""The store's blocks in host memory and its data plane: one KV-cache-shaped tensor of every layer
and KV head, written by a kv_transfer tcp receiver (Puts) and read by a tcp sender (Gets).

Holding whole blocks of all heads is what lets askers of any tensor- or pipeline-parallel layout
meet: a Put's transfer expects every (layer, block, head) page and completes only when every
rank of the publishing worker pushed its share (frames name their global layer and heads), and
a Get sends each asking rank the heads and layers it holds (`KVSender.start(heads=, layers=)`),
as between prefill and decode workers of different sizes. Frames carry a transfer id and a
random token the store announced, sizes are checked, nothing is unpickled (kv_transfer/).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from pdmesh.kv_transfer.base import TransferSpec
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.receive_connector import advertised
from pdmesh.kv_transfer.stats import TransferStats
from pdmesh.kv_transfer.tcp_receiver import TcpReceiver
from pdmesh.kv_transfer.tcp_sender import TcpSender
from pdmesh.kvstore_service.types import FetchTarget, StoreGeometry


def page_geometry(geometry: StoreGeometry) -> PageGeometry:
    """The store's pages: every layer and KV head of the model."""
    return PageGeometry(
        num_layers=geometry.num_layers,
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_start=0,
        head_dim=geometry.head_dim,
        dtype=getattr(torch, geometry.dtype),
    )


def block_nbytes(geometry: StoreGeometry) -> int:
    """One block of every layer, K and V, every KV head: what a block costs the byte budget."""
    return geometry.num_layers * page_geometry(geometry).bytes_per_block


class BlockPool:
    """Callers may rely on: `expect` and `push` are thread-safe; a slot is written only by the
    transfer `expect` announced for it, and only until its future is done; `push` returns once
    every frame was acknowledged by every receiver (so it has read its slots), or raises
    TransferError (ValueError for endpoints that do not fit) having aborted every handle."""

    def __init__(
        self, geometry: StoreGeometry, capacity_blocks: int, bind: str, advertise: str | None
    ) -> None:
        self.geometry = geometry
        self.pages = page_geometry(geometry)
        # [num_layers, 2, capacity_blocks, block_size, num_kv_heads, head_dim]. Empty, not
        # zeroed: pages are committed by the OS as Puts first write them, and a slot is read
        # only after a Put filled it.
        self.cache = torch.empty(self.pages.cache_shape(capacity_blocks), dtype=self.pages.dtype)
        self.receiver = TcpReceiver(self.cache, self.pages, bind)
        try:
            self.sender = TcpSender(self.pages)
        except BaseException:
            self.receiver.close()
            raise
        self.endpoint = advertised(self.receiver.endpoint, advertise)

    def expect(
        self, slots: list[int], timeout_s: float
    ) -> tuple[TransferSpec, Future[TransferStats]]:
        """Announce a Put's transfer into `slots`: every layer and KV head of each."""
        spec = TransferSpec.new(slots, head_start=0, num_heads=self.pages.num_kv_heads)
        return spec, self.receiver.expect(spec, timeout_s)

    def push(self, slots: list[int], target: FetchTarget, timeout_s: float) -> TransferStats:
        """Send the blocks in `slots` to every endpoint of `target` (blocking; off the loop)."""
        ids = torch.tensor(slots, dtype=torch.int64)
        handles = []
        try:
            for ep in target.endpoints:
                layers = (ep.layer_start, ep.num_layers) if ep.num_layers else None
                handles.append(
                    self.sender.start(
                        ep.address,
                        target.transfer_id,
                        target.token,
                        len(slots),
                        heads=(ep.head_start, ep.num_heads),
                        layers=layers,
                    )
                )
            # Every layer's blocks are gathered and staged (copied) before this returns.
            self.sender.send_layers(handles, 0, self.cache, ids)
        except BaseException:
            for handle in handles:
                self.sender.abort(handle)
            raise
        deadline = time.monotonic() + timeout_s
        done: list[TransferStats] = []
        try:
            for handle in handles:
                done.append(self.sender.finish(handle, max(1e-3, deadline - time.monotonic())))
        finally:
            for handle in handles[len(done) + 1 :]:  # the one that raised aborted itself
                self.sender.abort(handle)
        return TransferStats(
            bytes=sum(s.bytes for s in done),
            seconds=max(s.seconds for s in done),
            frames=sum(s.frames for s in done),
        )

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
