"""Router settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdmesh.router.planner.config import PlannerConfig
from pdmesh.router.tool_parsers.registry import get_parser
from pdmesh.serving.auth import ApiKeys
from pdmesh.serving.tls import TLSConfig


@dataclass(frozen=True)
class RouterConfig:
    """prefill / decode: worker addresses (host:port). policy: 'kv' (Dynamo-style cost: prefix-miss
    prefill blocks x overlap_weight + active blocks; decode: least KV usage) or 'round_robin'.
    disagg_min_tokens: prompts with fewer uncached tokens are prefilled on the decode worker.
    max_failovers: how many times one request moves to another decode worker when its worker is
    lost or refuses it. tls: the router's certificate for its public API and its hops to
    workers; public_client_auth: clients of the public API must present a certificate signed by
    `tls.ca` too. api_keys: keys the public API (gRPC and HTTP) requires (none: open).
    tool_call_parser: the model's tool-call format for tool_choice "auto" (router/tool_parsers;
    None: the one its chat template asks for). kvstore: HOST:PORT of a KV store whose held
    prefixes the 'kv' policy counts as cheaper than a miss (None: none). load_aware_disagg: a
    prompt long enough for a prefill worker is prefilled on its decode worker when the prefill
    worker's queue would cost it more than its prefill costs the decode worker's batch
    (router/prefill_rate.py) and would make it miss slo_ttft_s (--slo-ttft-ms; None: no target),
    unless the prefill would stall the decode worker's streams past slo_itl_p99_s
    (--slo-itl-p99-ms, a target for the p99 of each stream's inter-token gaps; None: none).
    planner: switch workers of either role between prefill and decode with the load
    (router/planner/; None: roles change only by hand)."""

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
    max_failovers: int = 2
    tls: TLSConfig | None = None
    public_client_auth: bool = False
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    tool_call_parser: str | None = None
    kvstore: str | None = None
    load_aware_disagg: bool = False
    slo_ttft_s: float | None = None
    slo_itl_p99_s: float | None = None
    planner: PlannerConfig | None = None

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("the router needs at least one decode worker (--decode HOST:PORT).")
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight!r}.")
        if self.disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be >= 0, got {self.disagg_min_tokens!r}.")
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers!r}.")
        if self.tls is not None and not self.tls.can_serve:
            raise ValueError("a router with TLS needs its certificate: --tls-cert and --tls-key.")
        if self.public_client_auth and (self.tls is None or self.tls.ca is None):
            raise ValueError("public_client_auth needs TLS with a CA (--tls-ca).")
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)  # ValueError naming the flag and the choices
        for name, flag in (("slo_ttft_s", "--slo-ttft-ms"), ("slo_itl_p99_s", "--slo-itl-p99-ms")):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} ({flag}) must be > 0, got {value!r}.")
        for name in ("health_interval_s", "stats_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
