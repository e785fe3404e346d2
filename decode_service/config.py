"""Decode worker settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdmesh.engine.config import EngineConfig
from pdmesh.serving.data_parallel import DataParallelRank, check_rank
from pdmesh.serving.store_link import StoreOptions
from pdmesh.serving.tls import TLSConfig

PREFILL_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class DecodeConfig:
    """bind: gRPC host:port. kv_transport: the KV transport of pairs with prefill workers not in
    kv_transport_for (prefill worker host:port -> transport); `auto` is nccl for a GPU cache, tcp
    for a CPU one. kv_bind: where the KV data plane listens (the default transport's; the others
    bind a free port on its host); kv_advertise: the address prefill workers are told to push to
    (default: the bound one). prefill_failure_policy:
    'recompute' prefills here when a remote prefill or its transfer fails, 'fail' ends the
    request with UNAVAILABLE. prefill_timeout_s: how long a remote prefill (queueing, compute
    and the KV push) may take before that policy applies; kv_timeout_s: how long the last KV
    frames may trail the prefill's reply. max_waiting_requests: requests that wait for KV
    blocks beyond this are refused with RESOURCE_EXHAUSTED. metrics_bind: host:port of the
    Prometheus `/metrics` endpoint (None: no endpoint). tls: certificate and CA for the gRPC
    server and the calls to prefill workers and the KV store (None: plaintext). kvstore: the
    KV store to read prompts it prefills through and publish them to (None: none).
    drain_on_sigterm: SIGTERM first drains the worker (its running requests move to other
    decode workers, see drain.py), then it exits; a request not pulled within kv_timeout_s is
    recomputed elsewhere. data_parallel: which of its worker's data-parallel ranks this
    process is (data_parallel_size > 1; serving/data_parallel.py)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    bind: str = "127.0.0.1:50061"
    kv_transport: str = "auto"
    kv_transport_for: Mapping[str, str] = field(default_factory=dict)
    kv_bind: str = "tcp://127.0.0.1:0"
    kv_advertise: str | None = None
    prefill_failure_policy: str = "recompute"
    kv_timeout_s: float = 30.0
    prefill_timeout_s: float = 300.0
    metrics_bind: str | None = None
    max_waiting_requests: int = 1024
    tls: TLSConfig | None = None
    kvstore: StoreOptions | None = None
    drain_on_sigterm: bool = False
    data_parallel: DataParallelRank | None = None

    def __post_init__(self) -> None:
        check_rank(self.engine.data_parallel_size, self.data_parallel)
        if self.kvstore is not None and self.engine.world_size != 1:
            raise ValueError(
                "--kvstore needs a worker of one rank for now (tensor and pipeline parallel size "
                "1): the other ranks would fetch and push their own heads and layers."
            )
        if self.prefill_failure_policy not in PREFILL_FAILURE_POLICIES:
            raise ValueError(
                f"prefill_failure_policy must be one of {', '.join(PREFILL_FAILURE_POLICIES)}, "
                f"got {self.prefill_failure_policy!r}."
            )
        for name in ("kv_timeout_s", "prefill_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        if self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be >= 1, got {self.max_waiting_requests!r}."
            )
        if self.tls is not None and not self.tls.can_serve:
            raise ValueError("a decode worker with TLS needs --tls-cert and --tls-key.")
