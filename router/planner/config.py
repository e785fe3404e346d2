"""The planner's settings (`pdmesh router --planner`, `pdmesh up --planner`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    """interval_s: how often the planner looks and may switch one worker. slo_ttft_s /
    slo_itl_s: the latency targets the router measures requests against (time to first token;
    time between tokens); attainment: the share of requests (TTFT) or tokens (inter-token) within
    their target below which a side counts as starved. kv_low / kv_high: decode KV use (share of
    blocks) below which the decode pool may give up a worker (with the worker gone, the others'
    use must stay below kv_low) and above which it is starved. sustain: consecutive intervals a
    condition must hold before a switch; dwell_s: the least time between two switches (of any
    worker), so the mesh settles and is measured again before the next."""

    interval_s: float = 2.0
    slo_ttft_s: float = 1.5
    slo_itl_s: float = 0.04
    attainment: float = 0.9
    kv_low: float = 0.5
    kv_high: float = 0.85
    sustain: int = 3
    dwell_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "slo_ttft_s", "slo_itl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"planner {name} must be > 0, got {getattr(self, name)!r}.")
        if self.dwell_s < 0:
            raise ValueError(f"planner dwell_s must be >= 0, got {self.dwell_s!r}.")
        if self.sustain < 1:
            raise ValueError(f"planner sustain must be >= 1 interval, got {self.sustain!r}.")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"planner attainment must be in (0, 1], got {self.attainment!r}.")
        if not 0 < self.kv_low < self.kv_high <= 1:
            raise ValueError(
                f"planner KV thresholds need 0 < kv_low < kv_high <= 1, got kv_low "
                f"{self.kv_low!r} and kv_high {self.kv_high!r}."
            )
