"""Dispatch policies by name."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.router.policies.base import NO_TARGETS, DispatchPolicy, LocalTargets
from pdmesh.router.prefill_rate import PrefillRate

_POLICIES: dict[str, type[DispatchPolicy]] = {}


def register_policy(name: str) -> Callable[[type[DispatchPolicy]], type[DispatchPolicy]]:
    def deco(cls: type[DispatchPolicy]) -> type[DispatchPolicy]:
        _POLICIES[name] = cls
        return cls

    return deco


def create_policy(
    name: str,
    overlap_weight: float,
    disagg_min_tokens: int,
    rate: PrefillRate | None = None,
    targets: LocalTargets = NO_TARGETS,
) -> DispatchPolicy:
    from pdmesh.router.policies import kv_cost, round_robin  # noqa: F401 (registers them)

    if name not in _POLICIES:
        raise ValueError(
            f"unknown dispatch policy {name!r}; available: {', '.join(sorted(_POLICIES))}"
        )
    return _POLICIES[name](overlap_weight, disagg_min_tokens, rate, targets)
