"""The dispatch policy contract: which decode worker, and which prefill worker (if any)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdmesh.router.prefill_rate import PrefillRate
from pdmesh.router.registry import Worker

# What a prompt block the KV store holds costs a worker that lacks it, against computing it (1):
# a transfer of its KV instead of its prefill.
STORE_HIT_COST = 0.2


@dataclass(frozen=True)
class PromptInfo:
    num_tokens: int
    block_hashes: list[int]  # hash chain of the prompt's full blocks
    block_size: int
    store_blocks: int = 0  # leading full blocks a KV store holds (router --kvstore)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def uncached_tokens(self, decode: Worker) -> int:
        """Tokens a decode worker would compute to prefill the prompt itself: those after the
        blocks it likely caches or would fetch from the KV store."""
        held = max(decode.index.match(self.block_hashes), self.store_blocks)
        return max(0, self.num_tokens - held * self.block_size)

    def local_tokens(self, decode: Worker) -> int:
        """Tokens the decode worker computes before the prompt's first token if it prefills the
        prompt itself: the prompts this router gave it to prefill first, then its uncached part."""
        return decode.local_prefill_blocks * self.block_size + self.uncached_tokens(decode)

    def split(self, cached: int) -> tuple[int, int]:
        """For a worker holding the first `cached` blocks: (blocks it would fetch from the KV
        store, blocks it would compute)."""
        fetched = max(0, self.store_blocks - cached)
        return fetched, self.num_blocks - cached - fetched


@dataclass(frozen=True)
class LocalTargets:
    """The latency targets load-aware conditional disaggregation keeps (None: none).
    ttft_s: a request's time to first token (--slo-ttft-ms). itl_p99_s: the p99 of each
    stream's gaps between tokens (--slo-itl-p99-ms); a local prefill of s seconds puts a gap of
    about s into every stream its decode worker runs."""

    ttft_s: float | None = None
    itl_p99_s: float | None = None


NO_TARGETS = LocalTargets()

# The share of the TTFT target a prompt sent to the prefill pool may be predicted to take: the
# prediction (queue and prompt at the measured rate) errs, and at the target itself about one
# prompt in ten missed it (8B prefill-heavy load past one prefill GPU's rate, two H200s).
TTFT_HEADROOM = 0.8


@dataclass(frozen=True)
class Decision:
    decode: Worker
    prefill: Worker | None  # None: the decode worker prefills the prompt itself
    reason: str  # why, for logs and trace attributes
    prefill_miss_blocks: int = 0  # blocks the prefill worker is expected to compute
    # With prefill None: the prefill worker the decode worker turns to if the prefix is not in
    # its cache after all. The router's index runs ahead of the worker's cache (a prompt sent a
    # moment ago is cached only once its KV has arrived), and the worker checks its real cache.
    fallback: Worker | None = None


class DispatchPolicy(ABC):
    """Callers may rely on: `choose` returns a decode worker from `decode` (never empty) and a
    prefill worker from `prefill` or None; it does not mutate worker state.

    `rate`: the prefill rate the router measures, given when conditional disaggregation takes
    load into account (router --load-aware-disagg); `targets`: the latencies it keeps: see
    `local_under_load`."""

    def __init__(
        self,
        overlap_weight: float,
        disagg_min_tokens: int,
        rate: PrefillRate | None = None,
        targets: LocalTargets = NO_TARGETS,
    ) -> None:
        self.overlap_weight = overlap_weight
        self.disagg_min_tokens = disagg_min_tokens
        self.rate = rate
        self.targets = targets

    @abstractmethod
    def choose(
        self, prompt: PromptInfo, decode: list[Worker], prefill: list[Worker]
    ) -> Decision: ...

    def local_prefill(self, prompt: PromptInfo, decode: Worker) -> bool:
        """Whether the decode worker's likely-uncached part of the prompt is short enough to
        prefill there (the worker checks again against its real cache). Blocks the KV store
        holds count as cached: the worker fetches them instead."""
        return prompt.uncached_tokens(decode) < self.disagg_min_tokens

    def local_under_load(self, prompt: PromptInfo, decode: Worker, prefill: Worker) -> str:
        """Why the decode worker should prefill the prompt itself although it is long enough to
        send ("": it should not): the prefill worker's queue would make the prompt wait longer
        than the prompts this router already gave the decode worker to prefill and its own
        uncached part there, which hold up the worker's running batch (all from the measured
        prefill rate; nothing before it is measured); with a TTFT target, the
        prompt would miss it through the prefill worker; and with a p99 inter-token target, the
        local prefill would not stall the decode worker's running streams past it.

        A queue the TTFT target absorbs costs the prompt nothing it was promised, while a local
        prefill stalls every stream the decode worker runs: on two H200s, 8B chat load
        (512-token prompts) at 16-48 a second had a p99 inter-token latency of 58-68 ms when
        prompts went local on the queue alone, 8-10 ms with the target kept; and under a p99
        inter-token target of 25 ms, local 4,096-token prefills (stalls of 100-250 ms) halved the
        goodput of prefill-heavy load against sending every prompt (BENCHMARKS.md, 2026-11-28)."""
        if self.rate is None:
            return ""
        queued = prefill.inflight_blocks * prompt.block_size
        wait = self.rate.queue_wait_s(queued)
        stall = self.rate.local_s(prompt.uncached_tokens(decode))
        # Prompts the decode worker already prefills for this router come first there.
        local = self.rate.local_s(prompt.local_tokens(decode))
        if wait is None or stall is None or local is None or wait <= local:
            return ""
        itl = self.targets.itl_p99_s
        running = max(decode.load.num_running, decode.streams)
        if itl is not None and stall > itl and running > 0:
            return ""
        if self.targets.ttft_s is not None:  # the queue, then what the prefill worker misses
            miss = prompt.num_tokens - prefill.index.match(prompt.block_hashes) * prompt.block_size
            remote = self.rate.queue_wait_s(queued + miss)
            if remote is not None and remote <= TTFT_HEADROOM * self.targets.ttft_s:
                return ""
        return f"prefill queue on {prefill.address} ~{wait:.2f}s > local prefill ~{stall:.2f}s"

    def may_need_prefill(self, prompt: PromptInfo) -> bool:
        """Whether the prompt is long enough that the decode worker may hand it to a prefill
        worker (it does when its own cache misses at least disagg_min_tokens of it)."""
        return prompt.num_tokens >= self.disagg_min_tokens
