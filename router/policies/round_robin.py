"""Round-robin dispatch: the baseline the KV-aware policy is measured against."""

from __future__ import annotations

import itertools

from pdmesh.router.policies.base import (
    NO_TARGETS,
    Decision,
    DispatchPolicy,
    LocalTargets,
    PromptInfo,
)
from pdmesh.router.policies.registry import register_policy
from pdmesh.router.prefill_rate import PrefillRate
from pdmesh.router.registry import Worker


@register_policy("round_robin")
class RoundRobinPolicy(DispatchPolicy):
    def __init__(
        self,
        overlap_weight: float,
        disagg_min_tokens: int,
        rate: PrefillRate | None = None,
        targets: LocalTargets = NO_TARGETS,
    ) -> None:
        super().__init__(overlap_weight, disagg_min_tokens, rate, targets)
        self._next = itertools.count()

    def choose(self, prompt: PromptInfo, decode: list[Worker], prefill: list[Worker]) -> Decision:
        n = next(self._next)
        d = decode[n % len(decode)]
        if not prefill or not self.may_need_prefill(prompt):
            return Decision(d, None, "round robin; prefill locally")
        p = prefill[n % len(prefill)]
        if self.local_prefill(prompt, d):
            return Decision(d, None, "round robin; likely cached: prefill locally", fallback=p)
        if busy := self.local_under_load(prompt, d, p):
            return Decision(d, None, f"round robin; {busy}: prefill locally")
        return Decision(d, p, "round robin", prompt.num_blocks - p.index.match(prompt.block_hashes))
