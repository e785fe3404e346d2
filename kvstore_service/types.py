"""The KV store's wire vocabulary as plain values, shared by the store and its client: what blocks
look like (`StoreGeometry`), where a Put's blocks go (`PutTarget`) and where a Get's blocks go
(`FetchTarget`). Torch-free and free of the KV plane, so that any process (the router included)
may hold a client; protobuf only in `to_pb` / `from_pb`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from pdmesh.errors import InvalidRequest
from pdmesh.v1 import kvstore_pb2, worker_pb2

# KV dtypes the tcp transport moves (kv_transfer/frame.py's DTYPE_CODES), by torch name.
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
TRANSPORT = "tcp"
_U32 = 1 << 32
_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
TOKEN_NBYTES = 16
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})")


def check_uint(name: str, value: object, minimum: int) -> None:
    """InvalidRequest naming `name` unless `value` is an int in [minimum, 2**32)."""
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < _U32:
        raise InvalidRequest(
            f"{name} must be an integer in [{minimum}, 2**32), got {value!r}.", name
        )


def check_transfer(prefix: str, transfer_id: str, token: bytes) -> None:
    """InvalidRequest unless the id is 32 lowercase hex characters and the token 16 bytes."""
    if not isinstance(transfer_id, str) or not _TRANSFER_ID.fullmatch(transfer_id):
        name = f"{prefix}transfer_id"
        raise InvalidRequest(f"{name} must be 32 lowercase hex characters.", name)
    if not isinstance(token, bytes) or len(token) != TOKEN_NBYTES:
        name = f"{prefix}token"
        raise InvalidRequest(f"{name} must be {TOKEN_NBYTES} random bytes.", name)


def check_endpoint(name: str, address: str) -> None:
    """InvalidRequest unless `address` is tcp://host:port with a port in 1..65535."""
    m = _ENDPOINT.fullmatch(address) if isinstance(address, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise InvalidRequest(f"{name} must look like tcp://10.0.0.7:5555, got {address!r}.", name)


@dataclass(frozen=True)
class StoreGeometry:
    """What a store's blocks look like: every layer and every KV head of one model, `block_size`
    tokens a block. `model` names the weights (two models of one shape make different KV)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if not self.model or len(self.model) > 512:
            raise InvalidRequest(
                "geometry.model must name the model's weights (1 to 512 characters).",
                "geometry.model",
            )
        if self.dtype not in DTYPES:
            raise InvalidRequest(
                f"geometry.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.",
                "geometry.dtype",
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            check_uint(f"geometry.{name}", getattr(self, name), 1)

    def mismatch(self, other: StoreGeometry) -> str | None:
        """A sentence naming the fields where `other` differs from this, or None."""
        diff = [
            f"{f.name} {getattr(other, f.name)!r} (this store: {getattr(self, f.name)!r})"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "; ".join(diff) or None

    def to_pb(self) -> kvstore_pb2.KVGeometry:
        return kvstore_pb2.KVGeometry(**{f.name: getattr(self, f.name) for f in fields(self)})

    @staticmethod
    def from_pb(pb: kvstore_pb2.KVGeometry) -> StoreGeometry:
        return StoreGeometry(
            pb.model, pb.dtype, pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size
        )


@dataclass(frozen=True)
class RankEndpoint:
    """One receiving rank: its data-plane address and the global KV heads and layers it holds
    (num_layers 0: every layer). The proto's `KVEndpoint`, as kv_transfer's own endpoint."""

    address: str
    head_start: int
    num_heads: int
    layer_start: int = 0
    num_layers: int = 0

    def to_pb(self) -> worker_pb2.KVEndpoint:
        return worker_pb2.KVEndpoint(**{f.name: getattr(self, f.name) for f in fields(self)})

    @staticmethod
    def from_pb(pb: worker_pb2.KVEndpoint) -> RankEndpoint:
        return RankEndpoint(pb.address, pb.head_start, pb.num_heads, pb.layer_start, pb.num_layers)


@dataclass(frozen=True)
class FetchTarget:
    """A transfer the asker's receivers expect (each with `expect`, one TransferSpec naming the
    asker's block ids for the fetched blocks, in order): where a Get pushes them."""

    transfer_id: str
    token: bytes = field(repr=False)
    endpoints: tuple[RankEndpoint, ...]


@dataclass(frozen=True)
class PutTarget:
    """Where to push offered blocks [first_block, first_block + num_blocks): transfer blocks
    0 .. num_blocks - 1 to the store's `endpoint`, every layer and KV head (each rank its own
    heads and layers), within `timeout_s`."""

    endpoint: str
    transfer_id: str
    token: bytes = field(repr=False)
    first_block: int
    num_blocks: int
    timeout_s: float

    @staticmethod
    def from_pb(pb: kvstore_pb2.KVPutReply, first_block: int, full_blocks: int) -> PutTarget:
        """The reply to a Put of blocks [first_block, full_blocks), checked: InvalidRequest
        naming the field of a reply that does not make sense (the client's "garbage")."""
        if pb.transport != TRANSPORT:
            raise InvalidRequest(f"transport {pb.transport!r} is not {TRANSPORT}.", "transport")
        check_endpoint("endpoint", pb.endpoint)
        check_transfer("", pb.transfer_id, pb.token)
        if not first_block <= pb.first_block < pb.first_block + pb.num_blocks <= full_blocks:
            raise InvalidRequest(
                f"blocks [{pb.first_block}, {pb.first_block + pb.num_blocks}) are not within "
                f"the offer [{first_block}, {full_blocks}).",
                "num_blocks",
            )
        if pb.timeout_ms < 1:
            raise InvalidRequest("timeout_ms must be positive.", "timeout_ms")
        return PutTarget(
            pb.endpoint,
            pb.transfer_id,
            pb.token,
            pb.first_block,
            pb.num_blocks,
            pb.timeout_ms / 1000,
        )
