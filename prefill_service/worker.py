"""The prefill worker: runs a prompt and pushes its KV blocks, layer by layer while the forward
runs, to the decode worker that holds the destination blocks; returns the first token.

The layer hook runs on the engine thread inside the forward: right after layer L stored this
step's K/V, the blocks that are now complete for L are queued on the KV sender (which copies and
sends them from its own thread) while layers L+1... compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduler import ScheduledBatch
from pdmesh.kv_transfer import PageGeometry, SendHandle, TransferError, create_sender
from pdmesh.logger import get_logger
from pdmesh.observability.worker_collector import TransferTotals, WorkerSnapshot
from pdmesh.prefill_service.config import PrefillConfig
from pdmesh.prefill_service.metrics import PrefillMetrics
from pdmesh.prefill_service.tracing import record_prefill
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
    handles: list[SendHandle]
    first_block: int
    end_block: int
    sent: list[int]  # per layer: the next prompt block to push
    done: asyncio.Future[tuple[int, int]]  # (first token, cached prompt tokens)
    forward_ns: int = 0  # unix ns of its first forward step (queueing ends)


class PrefillWorker:
    def __init__(self, config: PrefillConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        runner = engine.runner
        attn = runner.model.attention_layers()[0]
        self.geometry = PageGeometry(
            num_layers=runner.kv_spec.num_layers,
            block_size=runner.kv_spec.block_size,
            num_kv_heads=attn.num_kv_heads,
            head_start=0,
            head_dim=runner.kv_spec.head_dim,
            dtype=runner.kv_spec.dtype,
        )
        self.cache = runner.kv_cache.data  # [L, 2, NB, BS, Hkv, D]
        self.sender = create_sender(config.kv_transport, self.geometry)
        self.loop = EngineLoop(engine, self._on_engine_deltas, on_fatal=self._on_fatal)
        runner.add_layer_hook(self._push_layer)
        self.fatal: BaseException | None = None
        self.prefills = 0
        self.metrics = PrefillMetrics(self.metrics_snapshot)
        self._jobs: dict[str, _Push] = {}  # engine thread only
        self._aio: asyncio.AbstractEventLoop | None = None

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self.stopped = asyncio.Event()
        self.loop.start()

    async def close(self) -> None:
        self.loop.stop()
        self.sender.close()

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self.stopped.set)

    def check(self, task: PrefillTask) -> None:
        """Reject a task this worker cannot serve (ValueError naming the field)."""
        if task.transport != self.config.kv_transport:
            raise ValueError(
                f"kv_target.transport {task.transport!r} is not this worker's "
                f"{self.config.kv_transport!r}."
            )
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
        started = time.perf_counter_ns()
        received_ns = time.time_ns()
        handles = [
            self.sender.start(d.address, task.transfer_id, task.token, task.num_blocks)
            for d in task.destinations
        ]
        assert self._aio is not None
        push = _Push(
            handles,
            task.first_block,
            task.first_block + task.num_blocks,
            [task.first_block] * self.geometry.num_layers,
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
            await self.loop.acall(
                lambda e: self._begin(e, task.request_id, task.prompt, params, push)
            )
            first_token, cached = await push.done
            prefill_ns = time.perf_counter_ns() - started
            first_token_ns = time.time_ns()
            stats = await asyncio.to_thread(
                lambda: [self.sender.finish(h, task.timeout_s) for h in handles]
            )
        except BaseException as exc:
            # Off the engine first, so no layer hook sends on a handle being aborted.
            await self.loop.acall(lambda e: self._cancel(e, task.request_id))
            for h in handles:
                self.sender.abort(h)
            record_prefill(task, self.geometry.num_layers, received_ns, push.forward_ns, 0, [], exc)
            raise
        self.prefills += 1
        transfer_s = max(s.seconds for s in stats)
        self.metrics.prefilled(prefill_ns, push.forward_ns - received_ns, transfer_s)
        record_prefill(
            task, self.geometry.num_layers, received_ns, push.forward_ns, first_token_ns, stats
        )
        return PrefillOutcome(
            first_token=first_token,
            cached_prompt_tokens=cached,
            prefill_ns=prefill_ns,
            kv_bytes=sum(s.bytes for s in stats),
            kv_send_ns=int(transfer_s * 1e9),
        )

    # -- engine thread ----------------------------------------------------------------------------
    def _begin(
        self, engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, push: _Push
    ) -> None:
        engine.add_request(rid, prompt, params)
        self._jobs[rid] = push

    def _cancel(self, engine: LLMEngine, rid: str) -> None:
        self._jobs.pop(rid, None)
        if engine.abort_request(rid) is not None:
            engine.release(rid)

    def _push_layer(self, layer: int, batch: ScheduledBatch) -> None:
        bs = self.geometry.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            push = self._jobs.get(seq.request_id)
            if push is None:
                continue
            if not push.forward_ns:
                push.forward_ns = time.time_ns()
            end = seq.num_computed_tokens + n
            # Blocks whose K/V is complete for this layer; the prompt's last one may be partial.
            upto = (
                push.end_block if end >= seq.num_prompt_tokens else min(end // bs, push.end_block)
            )
            start = push.sent[layer]
            if upto <= start:
                continue
            ids = seq.block_table[start:upto]
            k = self.cache[layer, 0, ids]  # [n, BS, Hkv, D]
            v = self.cache[layer, 1, ids]
            try:
                for handle in push.handles:
                    self.sender.send_layer(handle, layer, start - push.first_block, k, v)
            except (TransferError, ValueError) as e:
                # The transfer is broken (peer gone, handle aborted): stop pushing; finish()
                # reports the failure to the decode worker. Never let it stop the forward.
                log.warning("KV push for %s stopped: %s", seq.request_id, e)
                push.sent = [push.end_block] * len(push.sent)
                continue
            push.sent[layer] = upto

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
        """State for a Prometheus scrape, read from the scraping thread without waiting for the
        engine thread (plain counters and the sender's thread-safe stats)."""
        e = self.engine.stats()
        tx = self.sender.stats
        return WorkerSnapshot(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_blocks_total=e.num_blocks_total,
            kv_blocks_used=e.num_blocks_used,
            kv_blocks_free=e.num_blocks_free,
            prefix_queried_tokens=e.prefix_queried_tokens,
            prefix_hit_tokens=e.prefix_hit_tokens,
            num_preemptions=e.num_preemptions,
            transfer=TransferTotals(
                "send", tx.bytes_sent, tx.seconds_sending, tx.transfers, tx.transfers_failed
            ),
            expert_token_counts=self.engine.runner.expert_counts() or (),
            prefills={"remote": self.prefills},
        )

    async def stats(self) -> dict[str, object]:
        engine_stats = await self.loop.acall(lambda e: e.stats())
        experts = await self.loop.acall(lambda e: e.runner.expert_counts())
        tx = self.sender.stats
        return {
            "engine": engine_stats,
            "kv_bytes_sent": tx.bytes_sent,
            "kv_seconds": tx.seconds_sending,
            "kv_transfers": tx.transfers,
            "expert_token_counts": experts or [],
        }


def _resolve(future: asyncio.Future[tuple[int, int]], value: tuple[int, int]) -> None:
    if not future.done():
        future.set_result(value)
