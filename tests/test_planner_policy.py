"""The planner's policy on recorded observations: it switches once under sustained pressure,
not on a one-interval blip, not again within its dwell time, never the last worker of a role
nor one that takes one role only, and back to the starting split once the mesh is idle."""

from __future__ import annotations

import dataclasses

import pytest

from pdmesh.router.planner.config import PlannerConfig
from pdmesh.router.planner.policy import (
    DECODE_STARVED,
    IDLE,
    PREFILL_STARVED,
    Observation,
    PlanningPolicy,
    Switch,
    WorkerView,
    assess,
)

CONFIG = PlannerConfig(interval_s=1, slo_ttft_s=1.0, slo_itl_s=0.05, sustain=3, dwell_s=10)


def _decode(name: str, kv_used: int = 100, running: int = 2, home: str = "decode") -> WorkerView:
    return WorkerView(name, "decode", home, True, kv_used=kv_used, kv_total=1000, running=running)


def _prefill(name: str, queued: int = 0, home: str = "prefill") -> WorkerView:
    return WorkerView(name, "prefill", home, True, queued_tokens=queued, running=int(queued > 0))


def _prefill_heavy(t: float) -> Observation:
    """TTFT misses its target while two decode workers are nearly empty."""
    return Observation(
        t, (_prefill("p", 4000),), (_decode("a", running=3), _decode("b", running=1)), 0.4, 1.0, 4.0
    )


def _calm(t: float) -> Observation:
    """Both sides within target, a little of everything."""
    return Observation(t, (_prefill("p", 100),), (_decode("a"), _decode("b")), 1.0, 1.0, 0.1)


def _idle(t: float, prefill: tuple[WorkerView, ...], decode: tuple[WorkerView, ...]) -> Observation:
    def rest(w: WorkerView) -> WorkerView:
        return dataclasses.replace(w, queued_tokens=0, kv_used=0, running=0, waiting=0)

    return Observation(t, tuple(map(rest, prefill)), tuple(map(rest, decode)))


def _run(policy: PlanningPolicy, observations: list[Observation]) -> list[Switch | None]:
    return [policy.decide(o) for o in observations]


def test_sustained_prefill_pressure_switches_the_least_busy_decode_worker_once() -> None:
    decisions = _run(PlanningPolicy(CONFIG), [_prefill_heavy(t) for t in range(8)])
    # Three intervals in a row, then one switch; the pressure goes on, but the dwell holds.
    assert decisions[:2] == [None, None]
    assert decisions[2] == Switch("b", "prefill", PREFILL_STARVED)
    assert decisions[3:] == [None] * 5


def test_a_blip_is_not_a_trend() -> None:
    observations = [_calm(0), _prefill_heavy(1), _prefill_heavy(2), _calm(3), _prefill_heavy(4)]
    observations += [_prefill_heavy(5), _calm(6), _calm(7)]
    assert _run(PlanningPolicy(CONFIG), observations) == [None] * 8


def test_no_switch_back_within_the_dwell_time() -> None:
    policy = PlanningPolicy(CONFIG)
    assert _run(policy, [_prefill_heavy(t) for t in range(3)])[-1] is not None
    # Now b serves prefill and decode starves (inter-token latency misses): not before t = 12.
    decode_heavy = [
        Observation(
            t,
            (_prefill("p"), _prefill("b", home="decode")),
            (_decode("a", kv_used=900, running=20),),
            1.0,
            0.5,
            0.0,
        )
        for t in range(3, 16)
    ]
    decisions = _run(policy, decode_heavy)
    first = next(i for i, d in enumerate(decisions) if d is not None)
    assert decode_heavy[first].time == 12  # the switch at t=2, plus dwell_s
    # The worker that came from decode goes back first.
    assert decisions[first] == Switch("b", "decode", DECODE_STARVED)


def test_never_the_last_worker_of_a_role_nor_one_that_takes_one_role() -> None:
    alone = Observation(0, (_prefill("p", 4000),), (_decode("a"),), 0.2, 1.0, 4.0)
    assert assess(CONFIG, alone) is None  # one decode worker: it cannot give one up
    policy = PlanningPolicy(dataclasses.replace(CONFIG, sustain=1))
    assert policy.decide(alone) is None
    fixed = Observation(
        0,
        (_prefill("p", 4000),),
        tuple(dataclasses.replace(_decode(n), switchable=False) for n in "ab"),
        0.2,
        1.0,
        4.0,
    )
    assert policy.decide(fixed) is None
    # Decode-starved with one prefill worker: it stays.
    starved = Observation(0, (_prefill("p"),), (_decode("a", 950), _decode("b", 950)), 1.0, 0.3)
    assert assess(CONFIG, starved) == DECODE_STARVED
    assert policy.decide(starved) is None


def test_back_to_the_starting_split_when_idle() -> None:
    policy = PlanningPolicy(CONFIG)
    assert _run(policy, [_prefill_heavy(t) for t in range(3)])[-1] == Switch(
        "b", "prefill", PREFILL_STARVED
    )
    prefill, decode = (_prefill("p"), _prefill("b", home="decode")), (_decode("a"),)
    decisions = _run(policy, [_idle(t, prefill, decode) for t in range(3, 16)])
    assert [d for d in decisions if d is not None] == [Switch("b", "decode", IDLE)]
    assert assess(CONFIG, _idle(20, prefill, decode)) == IDLE
    # At home, idle switches nothing.
    home = _run(PlanningPolicy(CONFIG), [_idle(t, (_prefill("p"),), decode) for t in range(5)])
    assert home == [None] * 5


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, PREFILL_STARVED),
        ({"itl_attainment": 0.5}, None),  # both sides miss: moving a worker only moves misses
        ({"ttft_attainment": None}, PREFILL_STARVED),  # the queue alone would miss the target
        ({"ttft_attainment": None, "prefill_wait_s": None}, None),  # nothing says it misses
    ],
)
def test_what_counts_as_prefill_starved(change: dict, expected: str | None) -> None:
    assert assess(CONFIG, dataclasses.replace(_prefill_heavy(0), **change)) == expected


def test_a_decode_pool_that_would_fill_up_keeps_its_workers() -> None:
    busy = tuple(_decode(n, kv_used=300) for n in "ab")  # 30% each: 60% on one
    obs = dataclasses.replace(_prefill_heavy(0), decode=busy)
    assert assess(CONFIG, obs) is None


def test_bad_settings_are_refused_naming_them() -> None:
    for change, words in (
        ({"interval_s": 0}, "interval_s"),
        ({"sustain": 0}, "sustain"),
        ({"kv_low": 0.9, "kv_high": 0.8}, "kv_low"),
        ({"attainment": 1.5}, "attainment"),
    ):
        with pytest.raises(ValueError, match=words):
            PlannerConfig(**change)
