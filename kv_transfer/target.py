"""Where a prompt's KV goes: the decode ranks' endpoints and the transfer they announced, as the
decode worker sends them to a prefill worker (proto `KVTarget`; protobuf only in `to_pb` /
`from_pb`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdmesh.kv_transfer.connector import control_message
from pdmesh.v1 import worker_pb2


@control_message
class KVEndpoint:
    """One decode rank's receiver: its address and the global KV heads and layers it holds
    (num_layers 0: every layer, as a worker without pipeline stages announces it)."""

    address: str
    head_start: int
    num_heads: int
    layer_start: int = 0
    num_layers: int = 0

    def overlaps(self, heads: range, layers: range) -> bool:
        """Whether this rank holds any of `heads` in any of `layers` (global indices)."""
        mine = self.layers or layers
        return (
            self.head_start < heads.stop
            and heads.start < self.head_start + self.num_heads
            and mine.start < layers.stop
            and layers.start < mine.stop
        )

    @property
    def layers(self) -> range | None:
        """The layers held, None for every layer."""
        if not self.num_layers:
            return None
        return range(self.layer_start, self.layer_start + self.num_layers)

    def to_pb(self) -> worker_pb2.KVEndpoint:
        return worker_pb2.KVEndpoint(**dataclasses.asdict(self))

    @staticmethod
    def from_pb(pb: worker_pb2.KVEndpoint) -> KVEndpoint:
        return KVEndpoint(pb.address, pb.head_start, pb.num_heads, pb.layer_start, pb.num_layers)


@dataclass(frozen=True)
class KVTarget:
    """A transfer announced by a decode worker: push prompt blocks first_block .. first_block +
    len(block_ids) - 1 over `transport` to `endpoints` (one per decode rank)."""

    transport: str
    transfer_id: str
    token: bytes = field(repr=False)
    first_block: int  # prompt blocks the decode worker already holds
    block_ids: tuple[int, ...]  # the decode worker's blocks for the rest, in order
    block_size: int
    endpoints: tuple[KVEndpoint, ...]
    timeout_s: float
    trace_context: Mapping[str, str] = field(default_factory=dict)  # the receiver's span

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def to_pb(self) -> worker_pb2.KVTarget:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        timeout_ms = int(fields.pop("timeout_s") * 1000)
        endpoints = [e.to_pb() for e in self.endpoints]
        return worker_pb2.KVTarget(**fields | {"endpoints": endpoints, "timeout_ms": timeout_ms})

    @staticmethod
    def from_pb(pb: worker_pb2.KVTarget, default_timeout_s: float) -> KVTarget:
        """`default_timeout_s` when the message names none."""
        return KVTarget(
            transport=pb.transport,
            transfer_id=pb.transfer_id,
            token=pb.token,
            first_block=pb.first_block,
            block_ids=tuple(pb.block_ids),
            block_size=pb.block_size,
            endpoints=tuple(KVEndpoint.from_pb(e) for e in pb.endpoints),
            timeout_s=pb.timeout_ms / 1000 if pb.timeout_ms else default_timeout_s,
            trace_context=dict(pb.trace_context),
        )
