"""The prefill worker: runs a prompt and pushes its KV blocks, layer by layer while the forward
runs, to the decode worker that holds the destination blocks; returns the first token.

Before each step rank 0 plans which prompt blocks the step completes; right after layer L
stored its K/V, every rank queues its heads of those blocks on its KV sender (which sends from
its own thread) while layers L+1... compute (see pusher.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduler import ScheduledBatch
from pdmesh.logger import get_logger
from pdmesh.observability.worker_collector import TransferTotals, WorkerSnapshot
from pdmesh.prefill_service.config import PrefillConfig
from pdmesh.prefill_service.metrics import PrefillMetrics
from pdmesh.prefill_service.pusher import ALL_LAYERS, ONE_LAYER, Endpoint, KVPusher
from pdmesh.prefill_service.tracing import record_prefill
from pdmesh.serving.convert import worker_stat_fields
from pdmesh.serving.engine_loop import EngineLoop

log = get_logger(__name__)


@dataclass(frozen=True)
class Destination:
    address: str
    head_start: int
    num_heads: int


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    transport: str
    transfer_id: str
    token: bytes
    first_block: int  # prompt blocks the decode worker already holds
    num_blocks: int  # blocks to push: prompt blocks first_block .. first_block + num_blocks - 1
    block_size: int
    destinations: list[Destination]
    timeout_s: float
    trace_context: Mapping[str, str] = field(default_factory=dict)  # the receiver's span


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    cached_prompt_tokens: int
    prefill_ns: int
    kv_bytes: int
    kv_send_ns: int


@dataclass
class _Push:
    job_id: int
    first_block: int
    end_block: int
    sent: int  # the next prompt block to push
    done: asyncio.Future[tuple[int, int]]  # (first token, cached prompt tokens)
    forward_ns: int = 0  # unix ns of the first forward step that ran this prompt


class PrefillWorker:
    """Rank 0 of a prefill worker (the only rank without tensor parallelism)."""

    RANK_EXTENSION = "pdmesh.prefill_service.rank_extension:PrefillRankExtension"

    def __init__(self, config: PrefillConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self.pusher = KVPusher(engine.runner)
        self.geometry = self.pusher.geometry
        engine.runner.set_step_planner(self._plan_step)
        self.loop = EngineLoop(engine, self._on_engine_deltas, on_fatal=self._on_fatal)
        if engine.tp_driver is not None:
            engine.tp_driver.on_rank_death = self.loop.fail
        self.fatal: BaseException | None = None
        self.prefills = 0
        self._jobs: dict[str, _Push] = {}  # engine thread only
        self._job_ids = itertools.count(1)
        self._aio: asyncio.AbstractEventLoop | None = None
        self.metrics = PrefillMetrics(self.metrics_snapshot)

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self.stopped = asyncio.Event()
        self.loop.start()

    async def close(self) -> None:
        self.loop.stop()
        self.pusher.close()
        self.engine.close()

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self.stopped.set)

    def check(self, task: PrefillTask) -> None:
        """Reject a task this worker cannot serve (ValueError naming the field)."""
        try:
            self.pusher.check(task.transport)
        except ValueError as e:
            raise ValueError(f"kv_target.transport: {e}") from None
        if task.block_size != self.geometry.block_size:
            raise ValueError(
                f"kv_target.block_size {task.block_size} differs from this worker's "
                f"{self.geometry.block_size}; prefill and decode workers need one block size."
            )
        prompt_blocks = -(-len(task.prompt) // task.block_size)
        if task.num_blocks < 1 or task.first_block + task.num_blocks != prompt_blocks:
            raise ValueError(
                f"kv_target names blocks {task.first_block}..{task.first_block + task.num_blocks}"
                f" of a prompt of {prompt_blocks} blocks."
            )
        if not task.destinations:
            raise ValueError("kv_target.endpoints must name at least one decode rank.")

    async def prefill(self, task: PrefillTask) -> PrefillOutcome:
        self.check(task)
        if self.fatal is not None:
            raise RuntimeError("this prefill worker's engine failed")
        started = time.perf_counter_ns()
        received_ns = time.time_ns()
        assert self._aio is not None
        push = _Push(
            next(self._job_ids),
            task.first_block,
            task.first_block + task.num_blocks,
            task.first_block,
            self._aio.create_future(),
        )
        # The first token is sampled as the request asks; nothing stops it early.
        params = SamplingParams(
            max_tokens=1,
            temperature=task.params.temperature,
            top_k=task.params.top_k,
            top_p=task.params.top_p,
            seed=task.params.seed,
            ignore_eos=True,
        )
        try:
            await self.loop.acall(lambda e: self._begin(e, task, params, push))
            first_token, cached = await push.done
            prefill_ns = time.perf_counter_ns() - started
            if self.pusher.done(push.job_id):  # usually, by the time the first token is out
                stats = self.pusher.finish(push.job_id, task.timeout_s)
            else:
                stats = await asyncio.to_thread(self.pusher.finish, push.job_id, task.timeout_s)
            if self.engine.tp_driver is not None:  # no hop to the engine thread without them
                await self.loop.acall(lambda e: self._followers(e, "kv.push_end", push, task))
        except BaseException as exc:
            # Off the engine thread's books first, so no layer hook sends on an aborted handle.
            await self.loop.acall(lambda e: self._cancel(e, task, push))
            record_prefill(task, self.geometry.num_layers, received_ns, push.forward_ns, 0, (), exc)
            raise
        first_token_ns = received_ns + prefill_ns
        record_prefill(
            task, self.geometry.num_layers, received_ns, push.forward_ns, first_token_ns, stats
        )
        transfer_s = max((s.seconds for s in stats), default=0.0)
        self.metrics.prefilled(prefill_ns, push.forward_ns - received_ns, transfer_s)
        self.prefills += 1
        return PrefillOutcome(
            first_token=first_token,
            cached_prompt_tokens=cached,
            prefill_ns=prefill_ns,
            kv_bytes=sum(s.bytes for s in stats),
            kv_send_ns=int(max((s.seconds for s in stats), default=0.0) * 1e9),
        )

    # -- engine thread ----------------------------------------------------------------------------
    def _followers(self, engine: LLMEngine, op: str, push: _Push, task: PrefillTask) -> None:
        if engine.tp_driver is None:
            return
        args: dict[str, object] = {"job_id": push.job_id, "timeout_s": task.timeout_s}
        if op == "kv.push_start":
            args.update(
                transport=task.transport,
                transfer_id=task.transfer_id,
                token=task.token.hex(),
                num_blocks=task.num_blocks,
                endpoints=[vars(d) for d in task.destinations],
            )
        engine.tp_driver.control(op, args)

    def _begin(
        self, engine: LLMEngine, task: PrefillTask, params: SamplingParams, push: _Push
    ) -> None:
        endpoints = [Endpoint(d.address, d.head_start, d.num_heads) for d in task.destinations]
        self.pusher.start(
            push.job_id, task.transport, task.transfer_id, task.token, task.num_blocks, endpoints
        )
        try:
            self._followers(engine, "kv.push_start", push, task)
            engine.add_request(task.request_id, task.prompt, params)
        except BaseException:
            self.pusher.abort(push.job_id)
            raise
        self._jobs[task.request_id] = push

    def _cancel(self, engine: LLMEngine, task: PrefillTask, push: _Push) -> None:
        self._jobs.pop(task.request_id, None)
        if engine.abort_request(task.request_id) is not None:
            engine.release(task.request_id)
        self.pusher.abort(push.job_id)
        self._followers(engine, "kv.push_abort", push, task)

    def _plan_step(self, batch: ScheduledBatch) -> torch.Tensor | None:
        bs = self.geometry.block_size
        items: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            push = self._jobs.get(seq.request_id)
            if push is None:
                continue
            if not push.forward_ns:
                push.forward_ns = time.time_ns()
            # Blocks complete before this step (cached here): every layer at once.
            cached = min(seq.num_computed_tokens // bs, push.end_block)
            if cached > push.sent:
                ids = seq.block_table[push.sent : cached]
                items += [push.job_id, push.sent - push.first_block, len(ids), ALL_LAYERS, *ids]
                push.sent = cached
            end = seq.num_computed_tokens + n
            # Blocks whose K/V this step completes; the prompt's last one may be partial.
            upto = (
                push.end_block if end >= seq.num_prompt_tokens else min(end // bs, push.end_block)
            )
            if upto <= push.sent:
                continue
            ids = seq.block_table[push.sent : upto]
            items += [push.job_id, push.sent - push.first_block, len(ids), ONE_LAYER, *ids]
            push.sent = upto
        return torch.tensor(items, dtype=torch.int64) if items else None

    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        for d in deltas:
            if d.finish_reason is None:
                continue
            push = self._jobs.pop(d.request_id, None)
            out = self.engine.get_output(d.request_id)
            self.engine.release(d.request_id)
            if push is not None and d.token_ids and self._aio is not None:
                result = (d.token_ids[0], out.num_cached_tokens)
                self._aio.call_soon_threadsafe(_resolve, push.done, result)

    def metrics_snapshot(self) -> WorkerSnapshot:
        """State for a Prometheus scrape, read from the scraping thread (no engine wait)."""
        e = self.engine.stats()
        return WorkerSnapshot(
            **worker_stat_fields(e),
            transfers=[
                TransferTotals(
                    "send",
                    name,
                    tx.bytes_sent,
                    tx.seconds_sending,
                    tx.transfers,
                    tx.transfers_failed,
                )
                for name, tx in self.pusher.stats_by_transport().items()
            ],
            expert_token_counts=self.engine.runner.expert_counts() or (),
            prefills={"remote": self.prefills},
        )

    async def stats(self) -> dict[str, object]:
        engine_stats = await self.loop.acall(lambda e: e.stats())
        experts = await self.loop.acall(lambda e: e.expert_counts())
        sent = [self.pusher.stats.bytes_sent]
        if self.engine.tp_driver is not None:
            replies = await self.loop.acall(lambda e: e.tp_driver.control("kv.stats", {}))
            sent += [r["bytes_sent"] for r in replies]
        tx = self.pusher.stats
        return {
            "engine": engine_stats,
            "kv_bytes_sent": sum(sent),
            "kv_seconds": tx.seconds_sending,
            "kv_transfers": tx.transfers,
            "expert_token_counts": experts or [],
        }


def _resolve(future: asyncio.Future[tuple[int, int]], value: tuple[int, int]) -> None:
    if not future.done():
        future.set_result(value)
