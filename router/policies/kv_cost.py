"""Dynamo-style KV-aware dispatch.

Prefill: cost(P) = (prefix-miss blocks on P + STORE_HIT_COST x blocks P would fetch from the KV
store) x overlap_weight + blocks P is busy with; the lowest cost wins, so a prompt goes where its
prefix is cached unless that worker is swamped, and a prefix the store holds (router --kvstore)
is cheaper than a miss everywhere. Decode: the worker with the least KV in use (its last stats
plus what was sent since). With a measured prefill rate (load-aware conditional
disaggregation), a prompt long enough to send is prefilled on the decode worker when the chosen
prefill worker's queue would cost it more than its prefill costs the decode worker's batch.
"""

from __future__ import annotations

from pdmesh.router.policies.base import STORE_HIT_COST, Decision, DispatchPolicy, PromptInfo
from pdmesh.router.policies.registry import register_policy
from pdmesh.router.registry import Worker


@register_policy("kv")
class KVCostPolicy(DispatchPolicy):
    def choose(self, prompt: PromptInfo, decode: list[Worker], prefill: list[Worker]) -> Decision:
        d = min(decode, key=lambda w: (w.kv_usage, w.load.num_running, w.address))
        if not prefill or not self.may_need_prefill(prompt):
            return Decision(d, None, f"decode {d.address}: least KV usage; prefill locally")

        def cost(w: Worker) -> tuple[float, str]:
            fetched, miss = prompt.split(w.index.match(prompt.block_hashes))
            work = (miss + fetched * STORE_HIT_COST) * self.overlap_weight
            return work + w.inflight_blocks + w.load.kv_blocks_used, w.address

        p = min(prefill, key=cost)
        if self.local_prefill(prompt, d):
            why = f"decode {d.address}: least KV usage, likely holds the prefix; prefill locally"
            return Decision(d, None, why, fallback=p)
        if busy := self.local_under_load(prompt, d, p):  # no fallback: the worker prefills it
            return Decision(d, None, f"decode {d.address}: least KV usage; {busy}: prefill locally")
        fetched, miss = prompt.split(p.index.match(prompt.block_hashes))
        return Decision(
            d,
            p,
            f"decode {d.address}: least KV usage; prefill {p.address}: cost {cost(p)[0]:.0f} "
            f"({miss} of {prompt.num_blocks} blocks uncached, {fetched} in the KV store)",
            miss,
        )
