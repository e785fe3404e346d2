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
from typing import Protocol

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
from pdmesh.serving.engine_loop import EngineLoop
from pdmesh.serving.store_link import Fetched, StoreLink
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


class PrefillHost(Protocol):
    """What `Prefills` needs of the worker process it runs in (WorkerProcess has it)."""

    engine: LLMEngine
    loop: EngineLoop
    store: StoreLink | None  # made when the worker starts

    def check_serving(self) -> None: ...


class Prefills:
    """The Prefill calls of one worker: each prompt runs in the host's engine with its KV pushed
    layer by layer through `kv`, and the call returns its first token. A worker of one role
    (PrefillWorker) takes them always; one that switches roles (worker_service) only while it
    serves prefill: `accepting` says so, and `finish` waits for the calls under way.

    Callers may rely on: `prefill` and `finish` on the event loop; `owns` and `on_deltas` on
    the engine thread."""

    def __init__(
        self, host: PrefillHost, kv: PushConnector, metrics: PrefillMetrics, timeout_s: float
    ) -> None:
        """timeout_s: how long a push may take when its request names no timeout."""
        self.host = host
        self.kv = kv
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.served = 0  # prompts prefilled for decode workers
        self.accepting = True
        self._calls = 0  # Prefill calls under way (event loop)
        self._idle: asyncio.Event | None = None  # set when none is
        self._pending: dict[str, _Pending] = {}  # engine thread only

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
        block_size = self.kv.geometry.block_size
        if target.block_size != block_size:
            raise InvalidRequest(
                f"kv_target.block_size {target.block_size} differs from this worker's "
                f"{block_size}; prefill and decode workers need one block size.",
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

    async def finish(self) -> int:
        """Stop accepting Prefill calls and wait for those under way; how many there were."""
        self.accepting = False
        under_way = self._calls
        if self._calls:
            self._idle = self._idle or asyncio.Event()
            await self._idle.wait()
        return under_way

    async def prefill(self, task: PrefillTask) -> PrefillOutcome:
        if not self.accepting:
            raise Unavailable("this worker serves decode now; prefill the prompt elsewhere.")
        self.check(task)
        self.host.check_serving()
        self._calls += 1
        try:
            return await self._prefill(task)
        finally:
            self._calls -= 1
            if not self._calls and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def _prefill(self, task: PrefillTask) -> PrefillOutcome:
        host = self.host
        started = time.perf_counter_ns()
        received_ns = time.time_ns()
        pending = _Pending(asyncio.get_running_loop().create_future())
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
            await asyncio.to_thread(host.engine.grammars.compile, params.structured_outputs)
        try:
            fetched = None
            if host.store is not None:
                fetched = await host.store.read_through(task.prompt)
            await host.loop.acall(lambda e: self._begin(e, task, params, pending, fetched))
            job = pending.job
            assert job is not None
            prefilled = await pending.done
            prefill_ns = time.perf_counter_ns() - started
            if self.kv.done(job):  # usually, by the time the first token is out
                stats = self.kv.finish(job.job_id, timeout_s)
            else:
                stats = await asyncio.to_thread(self.kv.finish, job.job_id, timeout_s)
            if self.kv.followers is not None:  # no hop to the engine thread without them
                await host.loop.acall(lambda e: self.kv.end(job, timeout_s))
        except BaseException as exc:
            # Off the engine thread's books first, so no layer hook sends on an aborted handle.
            await host.loop.acall(lambda e: self._cancel(e, task.request_id, pending))
            forward_ns = pending.job.forward_ns if pending.job is not None else 0
            record_prefill(task, self.kv.geometry.num_layers, received_ns, forward_ns, 0, (), exc)
            if isinstance(exc, TransferError):
                raise Unavailable(f"KV transfer failed: {exc}") from None
            raise
        first_token_ns = received_ns + prefill_ns
        record_prefill(
            task, self.kv.geometry.num_layers, received_ns, job.forward_ns, first_token_ns, stats
        )
        transfer_s = max((s.seconds for s in stats), default=0.0)
        self.metrics.prefilled(prefill_ns, job.forward_ns - received_ns, transfer_s)
        self.served += 1
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
        store = self.host.store
        if store is not None:  # fetched blocks join the prefix cache, whatever comes next
            known = store.settle(engine, task.prompt, fetched)
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

    def owns(self, request_id: str) -> bool:
        """Whether a request of the engine is one of these prefills."""
        return request_id in self._pending

    def on_deltas(self, deltas: list[StepDelta]) -> None:
        """Each step's deltas of these prefills (engine thread)."""
        store, engine = self.host.store, self.host.engine
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
            if publish is not None and store is not None and computed:
                store.published(engine, *publish)
            out = engine.get_output(rid)
            engine.release(rid)
            if pending is None:
                continue
            aio = pending.done.get_loop()
            if out.error is not None:
                # The engine ended it alone (its constraints left nothing to sample, a fault of
                # its own): the caller gets the error; the batch ran on.
                error = from_status(out.error.status, out.error.message, out.error.field)
                aio.call_soon_threadsafe(_reject, pending.done, error)
            elif pending.firsts:
                firsts = [pending.firsts[i] for i in sorted(pending.firsts)]
                logprobs = [lp for _, lp in firsts if lp is not None]
                result = _Prefilled(
                    [t for t, _ in firsts],
                    out.num_cached_tokens,
                    logprobs if len(logprobs) == len(firsts) else None,
                    pending.prompt_logprobs,
                )
                aio.call_soon_threadsafe(_resolve, pending.done, result)


class PrefillWorker(WorkerProcess):
    """Rank 0 of a prefill worker (the only rank without tensor parallelism)."""

    role = "prefill"

    def __init__(self, config: PrefillConfig, connector: PushConnector, engine: LLMEngine) -> None:
        super().__init__(engine, connector, store=config.kvstore, tls=config.tls)
        self.config = config
        self.kv = connector
        self.metrics = PrefillMetrics(self.metrics_snapshot)
        self.requests = Prefills(self, connector, self.metrics, config.kv_send_timeout_s)

    @property
    def prefills(self) -> dict[str, int]:  # type: ignore[override]
        return {"remote": self.requests.served}

    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        self.requests.on_deltas(deltas)


def _resolve(future: asyncio.Future[_Prefilled], value: _Prefilled) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future[_Prefilled], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
