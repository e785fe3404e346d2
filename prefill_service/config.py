"""Prefill worker settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.engine.config import EngineConfig
from pdmesh.serving.data_parallel import DataParallelRank, check_rank
from pdmesh.serving.store_link import StoreOptions
from pdmesh.serving.tls import TLSConfig


@dataclass(frozen=True)
class PrefillConfig:
    """bind: gRPC host:port. kv_send_timeout_s: how long pushing one prompt's KV may take (over
    the transport the decode worker names: any that moves this worker's cache). metrics_bind:
    host:port of the Prometheus `/metrics` endpoint (None: no endpoint). tls: certificate and
    CA of the gRPC server and of calls to the KV store (None: plaintext). kvstore: the KV store
    to read prompts through and publish them to (None: none). data_parallel: which of its
    worker's data-parallel ranks this process is (data_parallel_size > 1;
    serving/data_parallel.py)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    bind: str = "127.0.0.1:50071"
    kv_send_timeout_s: float = 30.0
    metrics_bind: str | None = None
    tls: TLSConfig | None = None
    kvstore: StoreOptions | None = None
    data_parallel: DataParallelRank | None = None

    def __post_init__(self) -> None:
        check_rank(self.engine.data_parallel_size, self.data_parallel)
        if self.kvstore is not None and self.engine.world_size != 1:
            raise ValueError(
                "--kvstore needs a worker of one rank for now (tensor and pipeline parallel size "
                "1): the other ranks would fetch and push their own heads and layers."
            )
        if self.kv_send_timeout_s <= 0:
            raise ValueError(f"kv_send_timeout_s must be > 0, got {self.kv_send_timeout_s!r}.")
        if self.tls is not None and not self.tls.can_serve:
            raise ValueError("a prefill worker with TLS needs --tls-cert and --tls-key.")
