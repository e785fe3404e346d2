"""The KV-transfer contract: transfer specs, and the receiver and sender interfaces (what a rank's
pages look like: geometry.py).

A worker's KV cache is one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads,
head_dim] (engine/kv_cache/paged.py); a rank holds global KV heads [head_start, head_start +
num_kv_heads). A transfer moves some blocks of every layer from a prefill rank (sender) into
blocks of a decode rank (receiver). The receiver announces it with `expect` (ids and token arrive
over the gRPC control plane), the sender pushes it layer by layer as prefill computes it.
Sender and receiver may hold different head ranges (different TP sizes) and different layer
ranges (different pipeline stages): every frame names its global layer and heads, a sender sends
each receiver only the layers it holds, and the receiver writes the intersection with its heads.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

from torch import Tensor

from pdmesh.kv_transfer.frame import (
    DTYPE_CODES,
    ID_NBYTES,
    TOKEN_NBYTES,
    FrameHeader,
    payload_nbytes,
)
from pdmesh.kv_transfer.geometry import PageGeometry, check_count, head_overlap
from pdmesh.kv_transfer.pages import gather_blocks
from pdmesh.kv_transfer.stats import ReceiverStats, SenderStats, TransferStats

if TYPE_CHECKING:  # inbox.py builds on this module
    from pdmesh.kv_transfer.inbox import TransferInbox

_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")


class TransferError(Exception):
    """A transfer did not complete: the peer is gone, a deadline passed, or it was cancelled or
    refused. The receiver's blocks of a failed transfer hold undefined (partial) data."""


def check_transfer_id(transfer_id: str) -> None:
    if not isinstance(transfer_id, str) or not _TRANSFER_ID.fullmatch(transfer_id):
        raise ValueError(f"transfer_id must be 32 lowercase hex characters, got {transfer_id!r}")


def check_token(token: bytes) -> None:
    if not isinstance(token, bytes) or len(token) != TOKEN_NBYTES:
        raise ValueError(f"a transfer token is {TOKEN_NBYTES} bytes (secrets.token_bytes)")


@dataclass(frozen=True)
class TransferSpec:
    """A transfer as the receiver announces it over the control plane."""

    transfer_id: str  # 32 lowercase hex characters
    token: bytes = field(repr=False)  # 16 random bytes every frame must carry; never logged
    block_ids: tuple[int, ...]  # the receiver's block ids in sequence order: j -> block_ids[j]
    head_start: int  # global KV heads the receiver expects covered, normally its own range
    num_heads: int

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        check_token(self.token)
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if not self.block_ids:
            raise ValueError("a transfer needs at least one block id")
        for block_id in self.block_ids:
            check_count("TransferSpec", "block_ids[]", block_id, 0)
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"TransferSpec.block_ids repeats a block: {self.block_ids}")
        check_count("TransferSpec", "head_start", self.head_start, 0)
        check_count("TransferSpec", "num_heads", self.num_heads, 1)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def raw_id(self) -> bytes:
        """The id as it travels in frames."""
        return bytes.fromhex(self.transfer_id)

    @staticmethod
    def new(block_ids: Sequence[int], head_start: int, num_heads: int) -> TransferSpec:
        return TransferSpec(
            transfer_id=secrets.token_hex(ID_NBYTES),
            token=secrets.token_bytes(TOKEN_NBYTES),
            block_ids=tuple(block_ids),
            head_start=head_start,
            num_heads=num_heads,
        )


def _handle_layers(geometry: PageGeometry, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The (start, count) of the sender's global layers that a receiver holding `layers` needs."""
    if layers is None:
        return geometry.layer_start, geometry.num_layers
    start, end = head_overlap(geometry.layer_start, geometry.num_layers, *layers)
    if end <= start:
        raise ValueError(
            f"the receiver's layers [{layers[0]}, {layers[0] + layers[1]}) do not overlap this "
            f"sender's [{geometry.layer_start}, {geometry.layers.stop})"
        )
    return start, end - start


def _handle_heads(geometry: PageGeometry, heads: tuple[int, int] | None) -> tuple[int, int]:
    """The (start, count) of the sender's heads that a receiver holding `heads` needs."""
    if heads is None:
        return geometry.head_start, geometry.num_kv_heads
    start, end = head_overlap(geometry.head_start, geometry.num_kv_heads, *heads)
    count = end - start
    if count < 1:
        raise ValueError(
            f"the receiver's KV heads [{heads[0]}, {heads[0] + heads[1]}) do not overlap this "
            f"sender's [{geometry.head_start}, {geometry.head_end})"
        )
    return start, count


@dataclass(eq=False, repr=False)
class SendHandle:
    """One outgoing transfer: returned by `KVSender.start`, passed back to its other methods.
    A transport subclasses it (keyword-only fields) for its own progress."""

    endpoint: str
    transfer_id: str
    token: bytes
    num_blocks: int
    # The global KV heads and layers this transfer carries (the sender's the receiver holds).
    head_start: int
    num_heads: int
    layer_start: int
    num_layers: int
    ended: bool = field(default=False, init=False)  # caller side: finish() or abort() was called
    nbytes: int = field(default=0, init=False)  # payload bytes sent
    first_sent_at: float | None = field(default=None, init=False)  # time.monotonic()

    def __post_init__(self) -> None:
        check_transfer_id(self.transfer_id)
        check_token(self.token)
        check_count("SendHandle", "num_blocks", self.num_blocks, 1)
        self.raw_id = bytes.fromhex(self.transfer_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transfer_id} -> {self.endpoint})"

    def local_layers(self, geometry: PageGeometry) -> range:
        """The sender's cache indices of the layers this transfer carries."""
        start = self.layer_start - geometry.layer_start
        return range(start, start + self.num_layers)

    def header(self, geometry: PageGeometry, layer: int, first_block: int, n: int) -> FrameHeader:
        """The header of this transfer's frame of `n` blocks from `first_block` of one layer
        (`layer`: the sender's cache index; the frame names the global layer)."""
        g = geometry
        nbytes = payload_nbytes(n, g.block_size, self.num_heads, g.head_dim, g.dtype.itemsize)
        # Positional, in wire order (frame.py).
        return FrameHeader(
            self.raw_id, self.token, g.layer_start + layer, first_block, n, self.head_start,
            self.num_heads,
            g.block_size, g.head_dim, DTYPE_CODES[g.dtype], nbytes
        )  # fmt: skip


Handles = Sequence[SendHandle]  # the transfers one gathered layer goes to


class _Closes(ABC):
    """`with` closes it."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class KVReceiver(_Closes):
    """Receives pages into one rank's KV cache.

    Callers may rely on: `expect`, `cancel` and `stats` are thread-safe; the returned futures are
    `concurrent.futures.Future`s (wrap with `asyncio.wrap_future`) that resolve, on a transport
    thread, only after every announced block of every layer and every expected head has been
    written; frames are never trusted: anything that does not match an announced transfer and
    its token, or does not fit, is dropped and counted, never written and never raised. Once a
    transfer's future has failed or `cancel` has returned, none of its frames is written any more,
    so its blocks may be freed; cancelling the future itself has the same effect.
    """

    def __init__(self, inbox: TransferInbox) -> None:
        """Every transport checks and writes frames through one `TransferInbox`, which also
        answers `expect`, `cancel` and `stats`."""
        self.inbox = inbox
        self.cache = inbox.cache  # [L, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.geometry = inbox.geometry

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The address senders connect to, e.g. "tcp://127.0.0.1:41234"."""

    def expect(self, spec: TransferSpec, timeout: float) -> Future[TransferStats]:
        """Announce a transfer. Fails with TransferError after `timeout` seconds without
        completion. ValueError when the spec cannot fit this rank (block ids beyond the cache, no
        head in common, an id already announced)."""
        return self.inbox.expect(spec, timeout)

    def cancel(self, transfer_id: str) -> None:
        """Fail the transfer's future with TransferError and forget it; a no-op when unknown."""
        self.inbox.cancel(transfer_id)

    @property
    def stats(self) -> ReceiverStats:
        return self.inbox.stats

    @abstractmethod
    def close(self) -> None:
        """Stop receiving; open transfers fail. Idempotent."""


class KVSender(_Closes):
    """Pushes pages from one rank's KV cache.

    Callers may rely on: `send_layer` never blocks on the network (it copies and queues) and
    never raises for transport failures, only for arguments that do not fit (ValueError);
    failures surface in `finish`. Every started transfer must end with `finish` or `abort`. One
    handle's `send_layer` calls come from one thread at a time; different handles may be driven
    from different threads.
    """

    Handle: ClassVar[type[SendHandle]] = SendHandle  # what `start` makes for `_open`

    def __init__(self, geometry: PageGeometry) -> None:
        self.geometry = geometry
        self._lock = threading.Lock()  # guards _counts (a transport may guard more with it)
        self._counts = SenderStats()

    def start(
        self,
        endpoint: str,
        spec_id: str,
        token: bytes,
        num_blocks: int,
        heads: tuple[int, int] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> SendHandle:
        """Begin a transfer of `num_blocks` block indices to the receiver at `endpoint`.

        heads, layers: (start, count) of the global KV heads and layers the receiver holds; only
        this sender's heads and layers inside them are sent (default: all of them; the layers
        outside are skipped by `send_blocks` and `send_layers`). ValueError if none are.
        """
        g = self.geometry
        heads, layers = _handle_heads(g, heads), _handle_layers(g, layers)
        handle = self.Handle(endpoint, spec_id, token, num_blocks, *heads, *layers)
        self._open(handle)
        return handle

    @abstractmethod
    def _open(self, handle: Any) -> None:
        """Start `handle` (of this transport's `Handle` type) on this sender."""

    @abstractmethod
    def send_layer(
        self, handle: SendHandle, layer: int, first_block: int, k: Tensor, v: Tensor
    ) -> None:
        """Queue block indices [first_block, first_block + n) of one layer.

        k, v: [n, block_size, num_kv_heads, head_dim] of this rank. They are copied before this
        returns (on CUDA: the copy is queued on the current stream), so the caller may reuse them.
        """

    def send_blocks(
        self, handles: Handles, layer: int, first_block: int, pages: Tensor, block_ids: Tensor
    ) -> None:
        """`send_layer` to each handle that carries `layer` (a cache index) of blocks gathered
        from one layer of a cache: pages [2 (k, v), num_blocks, block_size, num_kv_heads,
        head_dim], block_ids (int64, on pages' device) the blocks to send as [first_block,
        first_block + len(block_ids)). Gathers once for all handles; a transport may instead
        gather each handle's heads straight into its frame."""
        handles = [h for h in handles if layer in h.local_layers(self.geometry)]
        if not handles:
            return
        kv = gather_blocks(pages, 1, block_ids)
        for handle in handles:
            self.send_layer(handle, layer, first_block, kv[0], kv[1])

    def send_layers(
        self, handles: Handles, first_block: int, cache: Tensor, block_ids: Tensor
    ) -> None:
        """`send_blocks` of every layer at once, for blocks already complete in `cache`
        [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (a prompt prefix this
        worker had cached). By default one layer after the other; a transport may gather several
        layers at a time and send them as one message."""
        self.geometry.check_pages(cache, (self.geometry.num_layers, 2), "cache")
        for layer in range(self.geometry.num_layers):
            self.send_blocks(handles, layer, first_block, cache[layer], block_ids)

    def done(self, handle: SendHandle) -> bool:
        """True when every frame was sent and `finish` would return at once, so a caller on an
        event loop may call it there; False when not, or not known without waiting."""
        return False

    @abstractmethod
    def finish(self, handle: SendHandle, timeout: float) -> TransferStats:
        """Wait until every queued frame was accepted by the receiver; TransferError when one
        was refused, the peer is gone, or `timeout` seconds pass (the transfer is then aborted)."""

    @abstractmethod
    def abort(self, handle: SendHandle) -> None:
        """Drop the transfer's unsent frames; does not wait."""

    @property
    def stats(self) -> SenderStats:
        """A snapshot of this sender's counters (thread-safe)."""
        with self._lock:
            return dataclasses.replace(self._counts)

    @abstractmethod
    def close(self) -> None:
        """Stop sending; open transfers fail. Idempotent."""
