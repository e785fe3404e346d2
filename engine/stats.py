"""The engine's figures: the KV cache's size at start, the counters `LLMEngine.stats` reports,
and the experts' load over every rank.

Each function takes the parts it reads, not the engine. The figures over every rank ask the
follower ranks through rank 0's driver, so they are read between steps only.
"""

from __future__ import annotations

import dataclasses

from pdmesh.engine.eplb.balancer import CountEplb, EplbCounts, EplbStats, ExpertBalancer
from pdmesh.engine.executor.driver import CountExperts, ExpertCounts, TPDriver
from pdmesh.engine.kv_cache.host.index import HostIndex
from pdmesh.engine.kv_cache.host.pool import HostPool
from pdmesh.engine.outputs import EngineStats
from pdmesh.engine.spec_decode.speculator import SpecStats
from pdmesh.logger import get_logger

log = get_logger(__name__)


def log_kv_cache(
    num_blocks: int, block_size: int, nbytes: int, max_len: int, pool: HostPool | None
) -> None:
    """Say at start how many tokens the KV cache holds, and how many requests of `max_len`
    tokens that makes (and the host tier's size)."""
    capacity = num_blocks * block_size
    log.info(
        "KV cache: %s tokens (%d blocks of %d, %.2f GiB); "
        "maximum concurrency for %s tokens per request: %.2fx",
        f"{capacity:,}",
        num_blocks,
        block_size,
        nbytes / 2**30,
        f"{max_len:,}",
        capacity / max_len,
    )
    if pool is not None:
        log.info("host KV tier: %d blocks (%.2f GiB a rank)", pool.num_slots, pool.nbytes / 2**30)


def with_spec_and_host_tier(
    stats: EngineStats,
    spec: SpecStats | None,
    host_index: HostIndex | None,
    pool: HostPool | None,
    block_size: int,
    block_bytes: int,
) -> EngineStats:
    """The scheduler's `stats` with speculative decoding's counts (`spec`; None: off) and the
    host tier's figures (None: no tier). `block_bytes`: a block's KV over the worker's ranks."""
    if spec is not None:
        stats = dataclasses.replace(
            stats, spec_draft_tokens=spec.proposed, spec_accepted_tokens=spec.accepted
        )
    if host_index is None or pool is None:
        return stats
    return dataclasses.replace(stats, **host_index.figures(block_size, block_bytes, pool.seconds))


def expert_counts(
    local: list[int] | None, driver: TPDriver | None, expert_parallel: bool
) -> list[int] | None:
    """Tokens routed to each expert since start, over every rank (None: a dense model).
    `local`: rank 0's counts; `driver`: the other ranks (None: one rank)."""
    counts = local
    if counts is None or driver is None or not expert_parallel:
        return counts  # without EP every rank routes every token: rank 0 saw them all
    for reply in driver.call(CountExperts()):
        assert isinstance(reply, ExpertCounts)
        counts = [a + b for a, b in zip(counts, reply.counts, strict=True)]
    return counts


def eplb_stats(balancer: ExpertBalancer | None, driver: TPDriver | None) -> EplbStats | None:
    """EPLB's figures over every rank, now (None: EPLB off). Between steps only: the
    followers are asked."""
    if balancer is None:
        return None
    counts = [balancer.counts()]
    if driver is not None:
        for reply in driver.call(CountEplb()):
            assert isinstance(reply, EplbCounts)
            counts.append(reply)
    return balancer.stats(counts)
