from pdmesh.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVGeometry(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class KVLookupRequest(_message.Message):
    __slots__ = ("geometry", "token_ids")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLookupReply(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class KVPutRequest(_message.Message):
    __slots__ = ("geometry", "token_ids", "first_block")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ...) -> None: ...

class KVPutReply(_message.Message):
    __slots__ = ("transport", "endpoint", "transfer_id", "token", "first_block", "num_blocks", "timeout_ms")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    endpoint: str
    transfer_id: str
    token: bytes
    first_block: int
    num_blocks: int
    timeout_ms: int
    def __init__(self, transport: _Optional[str] = ..., endpoint: _Optional[str] = ..., transfer_id: _Optional[str] = ..., token: _Optional[bytes] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("geometry", "token_ids", "first_block", "num_blocks", "transfer_id", "token", "endpoints", "timeout_ms")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    num_blocks: int
    transfer_id: str
    token: bytes
    endpoints: _containers.RepeatedCompositeFieldContainer[_worker_pb2.KVEndpoint]
    timeout_ms: int
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transfer_id: _Optional[str] = ..., token: _Optional[bytes] = ..., endpoints: _Optional[_Iterable[_Union[_worker_pb2.KVEndpoint, _Mapping]]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KVGetReply(_message.Message):
    __slots__ = ("num_blocks", "bytes", "send_ns", "token_ids")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEND_NS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes: int
    send_ns: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., send_ns: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVStoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("geometry", "capacity_bytes", "bytes_held", "capacity_blocks", "blocks_held", "blocks_pinned", "blocks_filling", "lookups", "lookup_blocks", "hit_blocks", "token_mismatches", "puts", "puts_failed", "blocks_stored", "bytes_in", "gets", "gets_failed", "blocks_served", "bytes_out", "evictions", "hit_rate")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PINNED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FILLING_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GETS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    geometry: KVGeometry
    capacity_bytes: int
    bytes_held: int
    capacity_blocks: int
    blocks_held: int
    blocks_pinned: int
    blocks_filling: int
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    token_mismatches: int
    puts: int
    puts_failed: int
    blocks_stored: int
    bytes_in: int
    gets: int
    gets_failed: int
    blocks_served: int
    bytes_out: int
    evictions: int
    hit_rate: float
    def __init__(self, geometry: _Optional[_Union[KVGeometry, _Mapping]] = ..., capacity_bytes: _Optional[int] = ..., bytes_held: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., blocks_held: _Optional[int] = ..., blocks_pinned: _Optional[int] = ..., blocks_filling: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., token_mismatches: _Optional[int] = ..., puts: _Optional[int] = ..., puts_failed: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., bytes_in: _Optional[int] = ..., gets: _Optional[int] = ..., gets_failed: _Optional[int] = ..., blocks_served: _Optional[int] = ..., bytes_out: _Optional[int] = ..., evictions: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...
