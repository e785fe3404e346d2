from pdmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("role", "previous", "migrated", "recomputed", "prefills_finished")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous: str
    migrated: int
    recomputed: int
    prefills_finished: int
    def __init__(self, role: _Optional[str] = ..., previous: _Optional[str] = ..., migrated: _Optional[int] = ..., recomputed: _Optional[int] = ..., prefills_finished: _Optional[int] = ...) -> None: ...

class SetWorkerRoleRequest(_message.Message):
    __slots__ = ("worker", "role")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    role: str
    def __init__(self, worker: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "subscriber_id", "prompt_token_ids", "sampling", "prefill_address", "disagg_min_tokens", "deadline_unix_ms", "arrival_unix_ns", "num_output_tokens_sent", "migrate_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_SENT_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    subscriber_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    prefill_address: str
    disagg_min_tokens: int
    deadline_unix_ms: int
    arrival_unix_ns: int
    num_output_tokens_sent: int
    migrate_from: MigrateFrom
    def __init__(self, request_id: _Optional[str] = ..., subscriber_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., disagg_min_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., arrival_unix_ns: _Optional[int] = ..., num_output_tokens_sent: _Optional[int] = ..., migrate_from: _Optional[_Union[MigrateFrom, _Mapping]] = ...) -> None: ...

class MigrateFrom(_message.Message):
    __slots__ = ("address", "handle")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    handle: str
    def __init__(self, address: _Optional[str] = ..., handle: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber_id",)
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    def __init__(self, subscriber_id: _Optional[str] = ...) -> None: ...

class StepUpdate(_message.Message):
    __slots__ = ("deltas",)
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    def __init__(self, deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "error_code", "error_message", "logprobs", "prompt_logprobs", "index", "moved", "error_field")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _generation_pb2.FinishReason
    usage: _generation_pb2.Usage
    timings: _generation_pb2.Timings
    error_code: int
    error_message: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    index: int
    moved: Moved
    error_field: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_generation_pb2.Timings, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., moved: _Optional[_Union[Moved, _Mapping]] = ..., error_field: _Optional[str] = ...) -> None: ...

class Moved(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("migrated", "recomputed")
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    migrated: int
    recomputed: int
    def __init__(self, migrated: _Optional[int] = ..., recomputed: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("handle", "kv_target", "token_ids")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    kv_target: KVTarget
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[str] = ..., kv_target: _Optional[_Union[KVTarget, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MigrateReply(_message.Message):
    __slots__ = ("kv_bytes",)
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    def __init__(self, kv_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "prefix_queried_tokens", "prefix_hit_tokens", "num_preemptions", "kv_bytes_received", "kv_bytes_sent", "kv_seconds", "kv_transfers", "kv_frames_dropped", "local_prefills", "remote_prefills", "prefill_fallbacks", "expert_token_counts", "block_size", "tensor_parallel_size", "steps_launched_ahead", "pipeline_parallel_size", "physical_expert_token_counts", "eplb_rebalances", "eplb_imbalance", "fork_blocks_shared", "fork_blocks_copied", "host_tier_blocks_total", "host_tier_blocks_used", "host_tier_hit_blocks", "host_tier_hit_tokens", "host_tier_offloaded_bytes", "host_tier_loaded_bytes", "host_tier_copy_seconds", "spec_draft_tokens", "spec_accepted_tokens", "store_lookups", "store_lookup_blocks", "store_hit_blocks", "store_hit_tokens", "store_fetch_failures", "store_fetched_bytes", "store_fetch_seconds", "store_published_blocks", "store_published_bytes", "store_publish_seconds", "store_hit_rate", "migrations_out", "migrations_in", "migration_fallbacks", "migration_bytes_sent", "migration_bytes_received", "draining", "process_start_unix_s", "data_parallel_size", "data_parallel_rank", "data_parallel_attention", "roles")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_LAUNCHED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_EXPERT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EPLB_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    EPLB_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    FORK_BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    FORK_BLOCKS_COPIED_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_OFFLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    STORE_LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STORE_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_PUBLISHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_PUBLISH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    kv_bytes_received: int
    kv_bytes_sent: int
    kv_seconds: float
    kv_transfers: int
    kv_frames_dropped: int
    local_prefills: int
    remote_prefills: int
    prefill_fallbacks: int
    expert_token_counts: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    tensor_parallel_size: int
    steps_launched_ahead: int
    pipeline_parallel_size: int
    physical_expert_token_counts: _containers.RepeatedScalarFieldContainer[int]
    eplb_rebalances: int
    eplb_imbalance: float
    fork_blocks_shared: int
    fork_blocks_copied: int
    host_tier_blocks_total: int
    host_tier_blocks_used: int
    host_tier_hit_blocks: int
    host_tier_hit_tokens: int
    host_tier_offloaded_bytes: int
    host_tier_loaded_bytes: int
    host_tier_copy_seconds: float
    spec_draft_tokens: int
    spec_accepted_tokens: int
    store_lookups: int
    store_lookup_blocks: int
    store_hit_blocks: int
    store_hit_tokens: int
    store_fetch_failures: int
    store_fetched_bytes: int
    store_fetch_seconds: float
    store_published_blocks: int
    store_published_bytes: int
    store_publish_seconds: float
    store_hit_rate: float
    migrations_out: int
    migrations_in: int
    migration_fallbacks: int
    migration_bytes_sent: int
    migration_bytes_received: int
    draining: bool
    process_start_unix_s: float
    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_attention: bool
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_seconds: _Optional[float] = ..., kv_transfers: _Optional[int] = ..., kv_frames_dropped: _Optional[int] = ..., local_prefills: _Optional[int] = ..., remote_prefills: _Optional[int] = ..., prefill_fallbacks: _Optional[int] = ..., expert_token_counts: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., steps_launched_ahead: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., physical_expert_token_counts: _Optional[_Iterable[int]] = ..., eplb_rebalances: _Optional[int] = ..., eplb_imbalance: _Optional[float] = ..., fork_blocks_shared: _Optional[int] = ..., fork_blocks_copied: _Optional[int] = ..., host_tier_blocks_total: _Optional[int] = ..., host_tier_blocks_used: _Optional[int] = ..., host_tier_hit_blocks: _Optional[int] = ..., host_tier_hit_tokens: _Optional[int] = ..., host_tier_offloaded_bytes: _Optional[int] = ..., host_tier_loaded_bytes: _Optional[int] = ..., host_tier_copy_seconds: _Optional[float] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., store_lookups: _Optional[int] = ..., store_lookup_blocks: _Optional[int] = ..., store_hit_blocks: _Optional[int] = ..., store_hit_tokens: _Optional[int] = ..., store_fetch_failures: _Optional[int] = ..., store_fetched_bytes: _Optional[int] = ..., store_fetch_seconds: _Optional[float] = ..., store_published_blocks: _Optional[int] = ..., store_published_bytes: _Optional[int] = ..., store_publish_seconds: _Optional[float] = ..., store_hit_rate: _Optional[float] = ..., migrations_out: _Optional[int] = ..., migrations_in: _Optional[int] = ..., migration_fallbacks: _Optional[int] = ..., migration_bytes_sent: _Optional[int] = ..., migration_bytes_received: _Optional[int] = ..., draining: _Optional[bool] = ..., process_start_unix_s: _Optional[float] = ..., data_parallel_size: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ..., data_parallel_attention: _Optional[bool] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("transport", "transfer_id", "token", "first_block", "block_ids", "block_size", "endpoints", "timeout_ms", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    transfer_id: str
    token: bytes
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    endpoints: _containers.RepeatedCompositeFieldContainer[KVEndpoint]
    timeout_ms: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, transport: _Optional[str] = ..., transfer_id: _Optional[str] = ..., token: _Optional[bytes] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[KVEndpoint, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class KVEndpoint(_message.Message):
    __slots__ = ("address", "head_start", "num_heads", "layer_start", "num_layers")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    head_start: int
    num_heads: int
    layer_start: int
    num_layers: int
    def __init__(self, address: _Optional[str] = ..., head_start: _Optional[int] = ..., num_heads: _Optional[int] = ..., layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    kv_target: KVTarget
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., kv_target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token_id", "cached_prompt_tokens", "prefill_ns", "kv_bytes", "kv_send_ns", "first_token_logprobs", "prompt_logprobs", "first_token_ids")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    cached_prompt_tokens: int
    prefill_ns: int
    kv_bytes: int
    kv_send_ns: int
    first_token_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.PositionLogprobs]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token_id: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefill_ns: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_send_ns: _Optional[int] = ..., first_token_logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.PositionLogprobs, _Mapping]]] = ..., first_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
