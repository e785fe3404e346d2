"""Router settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """prefill / decode: worker addresses (host:port). policy: 'kv' (Dynamo-style cost: prefix-miss
    prefill blocks x overlap_weight + active blocks; decode: least KV usage) or 'round_robin'.
    disagg_min_tokens: prompts with fewer uncached tokens are prefilled on the decode worker."""

    model: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    bind: str = "127.0.0.1:50051"
    http_bind: str | None = "127.0.0.1:8000"
    policy: str = "kv"
    overlap_weight: float = 1.0
    disagg_min_tokens: int = 64
    health_interval_s: float = 1.0
    stats_interval_s: float = 0.5
    max_model_len: int | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("the router needs at least one decode worker (--decode HOST:PORT).")
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight!r}.")
        if self.disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be >= 0, got {self.disagg_min_tokens!r}.")
        for name in ("health_interval_s", "stats_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
