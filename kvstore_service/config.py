"""KV store settings (`pdmesh kvstore`'s flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdmesh.serving.auth import ApiKeys
from pdmesh.serving.tls import TLSConfig

GIB = 1 << 30
_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class KVStoreConfig:
    """bind: gRPC host:port. data_bind: the data plane's tcp://host:port (port 0: a free one,
    chosen at start). data_advertise: HOST or HOST:PORT workers push to and are pushed from
    (None: the bound address; needed when binding every interface). capacity_bytes: the byte
    budget of block payloads; the least recently used blocks are evicted beyond it.
    put_timeout_s: how long a Put's blocks may take to arrive before they are dropped.
    get_timeout_s: the longest a Get's push may take (a Get may ask for less).
    metrics_bind: host:port of `/metrics` (None: off). tls, api_keys: as every service's."""

    bind: str = "127.0.0.1:50081"
    data_bind: str = "tcp://127.0.0.1:50082"
    data_advertise: str | None = None
    capacity_bytes: int = 4 * GIB
    put_timeout_s: float = 30.0
    get_timeout_s: float = 30.0
    metrics_bind: str | None = None
    tls: TLSConfig | None = None
    api_keys: ApiKeys = field(default_factory=ApiKeys)

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 1:
            raise ValueError(
                f"the KV store's capacity must be positive, got {self.capacity_bytes}."
            )
        if self.capacity_bytes > physical_memory():
            raise ValueError(
                f"--capacity-gib {self.capacity_bytes / GIB:g} is more than this machine's "
                f"{physical_memory() / GIB:.1f} GiB of memory: the store holds its blocks in RAM."
            )
        for name in ("put_timeout_s", "get_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}.")
        host = self.data_bind.removeprefix("tcp://").rpartition(":")[0]
        if not self.data_bind.startswith("tcp://") or not host:
            raise ValueError(
                f"the data plane binds tcp://HOST:PORT (e.g. tcp://0.0.0.0:50082), got "
                f"{self.data_bind!r}."
            )
        if host in _WILDCARDS and not self.data_advertise:
            raise ValueError(
                "a data plane bound to every interface needs --data-advertise: the host (or "
                "host:port) workers reach this store at."
            )
        if self.tls is not None and not self.tls.can_serve:
            raise ValueError("a KV store with TLS needs --tls-cert and --tls-key.")
