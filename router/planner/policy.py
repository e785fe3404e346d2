"""What the planner decides from what it observes: pure, so recorded observations replay.

Each interval is one `Observation` of the workers in rotation and of the SLO attainment the
router measured since the last one. `assess` names the interval's condition:

- **prefill-starved**: time to first token misses its target (or the prefill queue alone would
  make it miss) while the decode pool is relaxed: inter-token latency within its target, KV use
  low enough that the other decode workers would hold it all below `kv_low`;
- **decode-starved**: inter-token latency misses its target, or a decode worker's KV use is
  above `kv_high`, while the prefill side is relaxed: TTFT within target, no queue to speak of;
- **idle**: nothing queued or running anywhere;
- none of these: leave the split alone (both starved means the mesh is short of workers, and
  moving one only moves the misses).

`PlanningPolicy.decide` turns conditions into at most one `Switch` per interval, with
hysteresis: a condition must hold `sustain` intervals in a row, and switches are `dwell_s`
apart. Prefill-starved moves the decode worker with the fewest running requests (the least to
migrate) to prefill; decode-starved the prefill worker with the least queued to decode; idle
moves one worker back to the role it started in (the operator's split), a prefill worker first
(it has no streams to move). Never the last worker in rotation of a role, never a worker that
takes one role only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdmesh.router.planner.config import PlannerConfig

PREFILL_STARVED = "prefill_starved"
DECODE_STARVED = "decode_starved"
IDLE = "idle"


@dataclass(frozen=True)
class WorkerView:
    """A worker in rotation as the router sees it. home: the role it started in (the router's
    --prefill / --decode lists); switchable: it takes either role; queued_tokens: prefill
    tokens this router sent it that have not come back as a first token; kv_used / kv_total:
    KV blocks; running / waiting: requests in its engine (its last stats)."""

    address: str
    role: str
    home: str
    switchable: bool
    queued_tokens: int = 0
    kv_used: int = 0
    kv_total: int = 0
    running: int = 0
    waiting: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    @property
    def busy(self) -> bool:
        return bool(self.queued_tokens or self.running or self.waiting)


@dataclass(frozen=True)
class Observation:
    """One interval. time: seconds (monotonic); ttft_attainment / itl_attainment: the share of
    requests whose first token came within the target, and of tokens that came within the
    inter-token target, since the last observation (None: no sample); prefill_wait_s: how long
    a prompt sent now would wait behind the prefill queue, from the measured prefill rate
    (None: not measured yet)."""

    time: float
    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    ttft_attainment: float | None = None
    itl_attainment: float | None = None
    prefill_wait_s: float | None = None


class Switch(NamedTuple):
    worker: str
    to_role: str
    reason: str  # PREFILL_STARVED, DECODE_STARVED or IDLE


def assess(config: PlannerConfig, obs: Observation) -> str | None:
    """The interval's condition (PREFILL_STARVED, DECODE_STARVED, IDLE) or None."""
    workers = obs.prefill + obs.decode
    if not any(w.busy for w in workers):
        return IDLE
    ttft_missed = obs.ttft_attainment is not None and obs.ttft_attainment < config.attainment
    itl_missed = obs.itl_attainment is not None and obs.itl_attainment < config.attainment
    wait = obs.prefill_wait_s
    queued = sum(w.queued_tokens for w in obs.prefill)
    used = sum(w.kv_used for w in obs.decode)
    total = sum(w.kv_total for w in obs.decode)
    # The decode pool's KV use if one of its workers (an average one) were gone.
    n = len(obs.decode)
    after = used / (total * (n - 1) / n) if n > 1 and total else 1.0
    decode_relaxed = not itl_missed and after < config.kv_low
    if (ttft_missed or (wait is not None and wait > config.slo_ttft_s)) and decode_relaxed:
        return PREFILL_STARVED
    kv_full = any(w.kv_usage >= config.kv_high for w in obs.decode)
    prefill_relaxed = not ttft_missed and (
        queued == 0 if wait is None else wait <= config.slo_ttft_s / 4
    )
    if (itl_missed or kv_full) and prefill_relaxed:
        return DECODE_STARVED
    return None


class PlanningPolicy:
    """`decide` once per interval, observations in time order; it remembers the current
    condition's run of intervals and the last switch (which it assumes made: a failed switch
    waits out the dwell time too, so a refused one is not retried every interval)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._condition: str | None = None
        self._streak = 0
        self._last_switch: float | None = None

    def decide(self, obs: Observation) -> Switch | None:
        condition = assess(self.config, obs)
        self._streak = self._streak + 1 if condition == self._condition else 1
        self._condition = condition
        if condition is None or self._streak < self.config.sustain:
            return None
        if self._last_switch is not None and obs.time - self._last_switch < self.config.dwell_s:
            return None
        switch = _pick(condition, obs)
        if switch is not None:
            self._last_switch = obs.time
            self._streak = 0
        return switch


def _pick(condition: str, obs: Observation) -> Switch | None:
    if condition == PREFILL_STARVED:
        return _move(obs.decode, "prefill", condition, lambda w: (w.running, w.kv_used))
    if condition == DECODE_STARVED:
        return _move(obs.prefill, "decode", condition, lambda w: (w.queued_tokens, w.running))
    # Idle: back toward the starting split, a prefill worker first (nothing to migrate).
    for pool, role in ((obs.prefill, "decode"), (obs.decode, "prefill")):
        away = [w for w in pool if w.home == role]
        if away and (switch := _move(away, role, condition, _nothing, len(pool))) is not None:
            return switch
    return None


def _nothing(w: WorkerView) -> tuple[int, ...]:
    return ()


def _move(
    pool: Sequence[WorkerView],
    role: str,
    reason: str,
    cost: Callable[[WorkerView], tuple[int, ...]],
    pool_size: int | None = None,
) -> Switch | None:
    """The cheapest switchable worker of `pool` to `role` (those started in `role` first),
    unless it is the last of its role in rotation."""
    if (pool_size if pool_size is not None else len(pool)) < 2:
        return None
    candidates = [w for w in pool if w.switchable]
    if not candidates:
        return None
    w = min(candidates, key=lambda w: (w.home != role, *cost(w), w.address))
    return Switch(w.address, role, reason)
