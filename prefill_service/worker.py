"""The prefill worker: runs a prompt and pushes its KV blocks, layer by layer while the forward
runs, to the decode worker that holds the destination blocks; returns the first token.

The KV side is `pdmesh.kv_transfer.push_connector`: rank 0 plans each step, and right after
layer L stored its K/V every rank queues its heads of the completed blocks on its KV sender
(which sends from its own thread) while layers L+1... compute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import PositionLogprobs, StepDelta
from pdmesh.errors import InvalidRequest, Unavailable, from_status
from pdmesh.kv_transfer.base import TransferError, check_token, check_transfer_id
from pdmesh.kv_transfer.push_connector import PushConnector, PushJob
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger
from pdmesh.prefill_service.config import PrefillConfig
from pdmesh.prefill_service.metrics import PrefillMetrics
from pdmesh.prefill_service.tracing import record_prefill
from pdmesh.sampling_params import SamplingParams
from pdmesh.serving.store_link import Fetched
from pdmesh.serving.worker_process import WorkerProcess

log = get_logger(__name__)


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    target: KVTarget


@dataclass(frozen=True)
class PrefillOutcome:
    """The fields of a PrefillReply."""

    first_token_id: int
    cached_prompt_tokens: int
    prefill_ns: int
    kv_bytes: int
    kv_send_ns: int
    first_token_logprobs: list[PositionLogprobs] | None = None  # per sequence, when computed
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when asked for
    first_token_ids: list[int] | None = None  # n or best_of > 1: one per sequence


@dataclass(frozen=True)
class _Prefilled:
    """The engine's part of a PrefillOutcome: a first token per sequence (n, best_of)."""

    first_token_ids: list[int]
    cached_prompt_tokens: int
    logprobs: list[PositionLogprobs] | None
    prompt_logprobs: list[PositionLogprobs | None] | None


@dataclass
class _Pending:
    done: asyncio.Future[_Prefilled]
    job: PushJob | None = None
    # Engine thread: each sequence's first token and its logprobs, by delta index.
    firsts: dict[int, tuple[int, PositionLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # With a KV store: the prompt, and how many of its leading blocks the store holds already.
    publish: tuple[list[int], int] | None = None


class PrefillWorker(WorkerProcess):
    """Rank 0 of a prefill worker (the only rank without tensor parallelism)."""

    role = "prefill"

    def __init__(self, config: PrefillConfig, connector: PushConnector, engine: LLMEngine) -> None:
        super().__init__(engine, connector, store=config.kvstore, tls=config.tls)
        self.config = config
        self.kv = connector
        self.prefills = {"remote": 0}
        self._pending: dict[str, _Pending] = {}  # engine thread only
        self.metrics = PrefillMetrics(self.metrics_snapshot)

    def check(self, task: PrefillTask) -> None:
        """Reject a task this worker cannot serve (InvalidRequest naming the field)."""
        target = task.target
        checks = (
            ("transport", lambda: self.kv.check(target.transport)),
            ("transfer_id", lambda: check_transfer_id(target.transfer_id)),
            ("token", lambda: check_token(target.token)),
        )
        for name, check in checks:
            try:
                check()
            except ValueError as e:
                raise InvalidRequest(f"kv_target.{name}: {e}", f"kv_target.{name}") from None
        if target.block_size != self.geometry.block_size:
            raise InvalidRequest(
                f"kv_target.block_size {target.block_size} differs from this worker's "
                f"{self.geometry.block_size}; prefill and decode workers need one block size.",
                "kv_target.block_size",
            )
        prompt_blocks = -(-len(task.prompt) // target.block_size)
        end = target.first_block + target.num_blocks
        if target.num_blocks < 1 or end != prompt_blocks:
            raise InvalidRequest(
                f"kv_target names blocks {target.first_block}..{end} of a prompt of "
                f"{prompt_blocks} blocks.",
                "kv_target.block_ids",
            )
        if not target.endpoints:
            raise InvalidRequest(
                "kv_target.endpoints must name at least one decode rank.", "kv_target.endpoints"
            )

    async def prefill(self, task: PrefillTask) -> PrefillOutcome:
        self.check(task)
        self.check_serving()
        started = time.perf_counter_ns()
        received_ns = time.time_ns()
        assert self._aio is not None
        pending = _Pending(self._aio.create_future())
        # The first token is sampled as the request asks (its penalties and bias included, and
        # not EOS or a stop token if min_tokens says so); nothing stops it early.
        params = dataclasses.replace(
            task.params,
            max_tokens=1,
            min_tokens=min(task.params.min_tokens, 1),
            stop=(),
            ignore_eos=True,
        )
        timeout_s = task.target.timeout_s
        if params.structured_outputs is not None:  # compiled here, not on the engine thread
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_outputs)
        try:
            fetched = None
            if self.store is not None:
                fetched = await self.store.read_through(task.prompt)
            await self.loop.acall(lambda e: self._begin(e, task, params, pending, fetched))
            job = pending.job
            assert job is not None
            prefilled = await pending.done
            prefill_ns = time.perf_counter_ns() - started
            if self.kv.done(job):  # usually, by the time the first token is out
                stats = self.kv.finish(job.job_id, timeout_s)
            else:
                stats = await asyncio.to_thread(self.kv.finish, job.job_id, timeout_s)
            if self.kv.followers is not None:  # no hop to the engine thread without them
                await self.loop.acall(lambda e: self.kv.end(job, timeout_s))
        except BaseException as exc:
            # Off the engine thread's books first, so no layer hook sends on an aborted handle.
            await self.loop.acall(lambda e: self._cancel(e, task.request_id, pending))
            forward_ns = pending.job.forward_ns if pending.job is not None else 0
            record_prefill(task, self.geometry.num_layers, received_ns, forward_ns, 0, (), exc)
            if isinstance(exc, TransferError):
                raise Unavailable(f"KV transfer failed: {exc}") from None
            raise
        first_token_ns = received_ns + prefill_ns
        record_prefill(
            task, self.geometry.num_layers, received_ns, job.forward_ns, first_token_ns, stats
        )
        transfer_s = max((s.seconds for s in stats), default=0.0)
        self.metrics.prefilled(prefill_ns, job.forward_ns - received_ns, transfer_s)
        self.prefills["remote"] += 1
        tokens = prefilled.first_token_ids
        return PrefillOutcome(
            first_token_id=tokens[0],
            cached_prompt_tokens=prefilled.cached_prompt_tokens,
            prefill_ns=prefill_ns,
            kv_bytes=sum(s.bytes for s in stats),
            kv_send_ns=int(transfer_s * 1e9),
            first_token_logprobs=prefilled.logprobs,
            prompt_logprobs=prefilled.prompt_logprobs,
            first_token_ids=tokens if len(tokens) > 1 else None,
        )

    # -- engine thread ----------------------------------------------------------------------------
    def _begin(
        self,
        engine: LLMEngine,
        task: PrefillTask,
        params: SamplingParams,
        pending: _Pending,
        fetched: Fetched | None = None,
    ) -> None:
        if self.store is not None:  # fetched blocks join the prefix cache, whatever comes next
            known = self.store.settle(engine, task.prompt, fetched)
            pending.publish = (list(task.prompt), known)
        job = self.kv.start(task.request_id, task.target)
        try:
            engine.add_request(task.request_id, task.prompt, params)
        except BaseException:
            self.kv.end(job, None)
            raise
        pending.job = job
        self._pending[task.request_id] = pending

    def _cancel(self, engine: LLMEngine, request_id: str, pending: _Pending) -> None:
        self._pending.pop(request_id, None)
        if engine.abort_request(request_id) is not None:
            engine.release(request_id)
        if pending.job is not None:
            self.kv.end(pending.job, None)

    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        for d in deltas:
            if d.finish_reason is None:
                continue
            rid = d.request_id
            pending = self._pending.get(rid)
            if pending is not None and d.token_ids:  # a sequence's one token (max_tokens 1)
                pending.firsts[d.index] = (d.token_ids[0], d.logprobs[0] if d.logprobs else None)
                if d.prompt_logprobs is not None:
                    pending.prompt_logprobs = d.prompt_logprobs
            if not d.request_finished:
                continue
            self._pending.pop(rid, None)
            self.kv.forget(rid)
            publish = pending.publish if pending is not None else None
            # Computed (not aborted, not ended by an error): its blocks are in the device cache.
            computed = d.finish_reason not in ("abort", "error")
            if publish is not None and self.store is not None and computed:
                self.store.published(self.engine, *publish)
            out = self.engine.get_output(rid)
            self.engine.release(rid)
            if pending is not None and out.error is not None and self._aio is not None:
                # The engine ended it alone (its constraints left nothing to sample, a fault of
                # its own): the caller gets the error; the batch ran on.
                error = from_status(out.error.status, out.error.message, out.error.field)
                self._aio.call_soon_threadsafe(_reject, pending.done, error)
            elif pending is not None and pending.firsts and self._aio is not None:
                firsts = [pending.firsts[i] for i in sorted(pending.firsts)]
                logprobs = [lp for _, lp in firsts if lp is not None]
                result = _Prefilled(
                    [t for t, _ in firsts],
                    out.num_cached_tokens,
                    logprobs if len(logprobs) == len(firsts) else None,
                    pending.prompt_logprobs,
                )
                self._aio.call_soon_threadsafe(_resolve, pending.done, result)


def _resolve(future: asyncio.Future[_Prefilled], value: _Prefilled) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future[_Prefilled], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
