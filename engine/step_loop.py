"""Stepping the engine: schedule a batch, launch it, read its tokens and output them.

`StepLoop` keeps the steps on the device whose tokens the host has not read yet: one launched
ahead (async scheduling, `scheduling/overlap.py`), a batch per pipeline stage, or a data-parallel
replica's step in lockstep with its peers. It outputs each sampled token to its request (stop
rules, ends, failures) and frees a finished sequence's blocks once no step in flight writes to
them. `LLMEngine` owns it; it knows the scheduler, the runner, the speculator and the engine's
table of requests, nothing of how requests come in.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection

from pdmesh import envs
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.executor.profiling import span
from pdmesh.engine.outputs import PositionLogprobs, RequestError, StepDelta, mark_request_ends
from pdmesh.engine.runner.model_runner import ModelRunner
from pdmesh.engine.scheduling.burst import COLLECT_WAITED_S, PrefillRate
from pdmesh.engine.scheduling.overlap import InFlight, next_decode
from pdmesh.engine.scheduling.request import Request, RequestFailed
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence
from pdmesh.engine.spec_decode.speculator import Speculator
from pdmesh.engine.spec_decode.step import verified_step
from pdmesh.logger import get_logger

log = get_logger(__name__)


class StepLoop:
    """The engine's steps: launched, in flight, handled. `requests`: the engine's requests by
    id, shared with it (the engine adds and releases them, the loop outputs their tokens)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        speculator: Speculator | None,
        requests: dict[str, Request],
        *,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.speculator = speculator
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefill_rate = PrefillRate()
        # The last step could do nothing: queued requests wait for blocks that prompts being
        # prefilled elsewhere hold (their KV's arrival is what unblocks it).
        self.stalled = False
        # Under data-parallel attention: whether any rank ran anything in the last step (an
        # idle rank keeps stepping while its peers are busy, their MoE layers need it).
        self.group_busy = False
        # Async scheduling (see overlap.py): on with CUDA graphs unless the config says.
        # Pipeline stages have a batch per stage in flight, and each batch's next step is
        # launched ahead too, beside the others, its input ids then on rank 0's device only:
        # only stages of one rank, whose first stage is rank 0 alone, can take them from there.
        # Data-parallel replicas under data-parallel attention launch one step each in lockstep
        # (`_lockstep`), the next one ahead of the tokens as well: on two H200s that took
        # DP=2 + EP=2 from 4.16 to 2.93 ms a token at batch 1 (BENCHMARKS.md, issue 30).
        self.async_scheduling = (
            config.pipeline_parallel_size == 1 or config.tensor_parallel_size == 1
        ) and (
            bool(config.async_scheduling)
            if config.async_scheduling is not None
            else runner.graphs is not None
        )
        # Steps launched whose tokens are not read yet, oldest first: one launched ahead (async
        # scheduling), or with pipeline stages one batch per stage, each of other sequences, so
        # that no stage waits for the others (vLLM's virtual engines). Steps with KV plans go
        # one at a time.
        self.inflight: deque[InFlight] = deque()
        pp = config.pipeline_parallel_size
        self.max_in_flight = 1 if runner.has_planner or pp == 1 else envs.pp_batches(pp)
        self.most_in_flight = 0  # the most batches on the device at once so far

    def request(self, request_id: str) -> Request | None:
        """The request as the loop serves it (None: not known here)."""
        return self.requests.get(request_id)

    def is_finished(self, request_id: str) -> bool:
        """Whether every choice of the request has ended (False for a request not known here)."""
        request = self.requests.get(request_id)
        return request is not None and request.is_finished

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """Run a step and return its deltas. The step handled may be one launched by an earlier
        call (async scheduling, pipeline stages), and others may be on the device on return."""
        if self.runner.dp is not None:
            return self._lockstep()
        cur = self.inflight.popleft() if self.inflight else self._launch()
        # Nothing to run: requests may wait for blocks that prompts prefilled elsewhere hold.
        self.stalled = cur is None and self.scheduler.num_reserved > 0
        if cur is None:
            if self.scheduler.has_unfinished() and not self.stalled:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        self._fill(cur)
        if cur.handle.verify is not None:  # a step that verified draft tokens
            return verified_step(self, cur)
        # cur's next step, launched before its tokens are read, beside the other batches in
        # flight (pipeline stages: then neither the device nor the host waits for the other).
        if self.async_scheduling and len(self.inflight) < self.max_in_flight:
            if cur.handle.sample is not None:  # pipeline stages: the tokens, on the device
                cur.handle.sample()
            nxt = self._launch_next(cur)
            if nxt is not None:
                self.inflight.append(nxt)
        return self._handle(cur)

    def _lockstep(self) -> list[StepDelta]:
        """A step of a data-parallel replica under data-parallel attention: exactly one forward
        launched (the replicas' MoE layers exchange tokens within each; a replica with nothing
        to run joins with padding) and at most one handled. With async scheduling the forward
        is the one after the step handled, launched before its tokens are read (or, when it
        cannot be, a new schedule once they are): a new batch's tokens come a call later.
        Sets `group_busy`: whether any rank ran anything in this call's step."""
        cur = self.inflight.popleft() if self.inflight else None
        self.group_busy = True
        if cur is None or not self.async_scheduling:
            launched = self._launch()
            self.stalled = launched is None and self.scheduler.num_reserved > 0
            if launched is None:
                self.group_busy = self.runner.idle_step()
                if self.scheduler.has_unfinished() and not self.stalled:
                    raise RuntimeError("scheduler made no progress with requests pending")
                return []
            if not self.async_scheduling:
                return self._handle(launched)
            self.inflight.append(launched)
            return []
        nxt = self._launch_next(cur)
        deltas = self._handle(cur)
        if nxt is None:  # this call's forward: a new schedule, now that cur's tokens are read
            nxt = self._launch()
        if nxt is None:
            self.group_busy = self.runner.idle_step() or bool(deltas)
        else:
            self.inflight.append(nxt)
        return deltas

    def _handle(self, cur: InFlight) -> list[StepDelta]:
        """Read a launched step's tokens and output them; its deltas."""
        with span("engine.collect"):  # waits for the step's tokens
            asked = time.perf_counter()
            sampled = self.runner.collect(cur.handle)
        done = time.perf_counter()
        # The step's time is known when its tokens were waited for, or read right after its
        # launch (no async scheduling). Tokens read only after the loop idled (a prefill
        # worker holding a finished prefill for its KV push) would count the idle time too:
        # on two H200s such samples held every idle prefill worker's burst wait at its cap.
        if not self.async_scheduling or done - asked > COLLECT_WAITED_S:
            self.prefill_rate.observe(cur.batch, done - cur.started)
        logprobs = self.runner.collect_logprobs(cur.handle, sampled)
        self.record_prompt_logprobs(cur)
        self.scheduler.complete(cur.batch)
        deltas: list[StepDelta] = []
        for i, (seq, token) in enumerate(zip(cur.batch.seqs, sampled, strict=True)):
            if token is not None and not seq.is_finished:  # else aborted while the step ran
                lp = logprobs[i] if logprobs is not None else None
                deltas.append(self.append_token(self.requests[seq.request_id], seq, token, lp))
        return mark_request_ends(deltas, self.is_finished)

    def record_prompt_logprobs(self, cur: InFlight) -> None:
        """Store the prompt logprobs a handled step computed with their requests."""
        for i, position, entry in cur.handle.prompt_logprobs:
            request = self.requests.get(cur.batch.seqs[i].request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs[position + 1] = entry  # predicts the next token

    def _launch(self, busy: Collection[Sequence] = ()) -> InFlight | None:
        """Schedule a step and launch it (None: nothing to run). `busy`: the sequences of the
        steps in flight, which sit this one out."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule(busy, self._batch_cap())
        if not batch:
            return None
        started = time.perf_counter()
        return InFlight(batch, self.runner.launch(batch), started)

    def _batch_cap(self) -> int | None:
        """With batches in flight for p stages, each takes about 1/p of the sequences."""
        if self.max_in_flight == 1:
            return None
        s = self.scheduler
        return -(-(len(s.running) + len(s.waiting)) // self.max_in_flight)

    def _fill(self, cur: InFlight) -> None:
        """Launch batches of other sequences while fewer than one per stage are in flight."""
        while 1 + len(self.inflight) < self.max_in_flight:
            busy = [seq for f in (cur, *self.inflight) for seq in f.batch.seqs]
            launched = self._launch(busy)
            if launched is None:
                break
            self.inflight.append(launched)
        self.most_in_flight = max(self.most_in_flight, 1 + len(self.inflight))

    def _launch_next(self, cur: InFlight) -> InFlight | None:
        if self.runner.has_planner:
            return None  # steps that push KV are planned one at a time
        if self.speculator is not None and self.speculator.active(len(self.scheduler.running)):
            return None  # drafts are proposed from every token so far
        nxt = next_decode(cur, self.scheduler, self.max_model_len, self.inflight)
        if nxt is None:
            return None
        batch, token_ids = nxt
        with span("engine.launch_next"):
            started = time.perf_counter()
            return InFlight(batch, self.runner.launch(batch, next_ids=token_ids), started)

    # -- a sequence's tokens and its end ------------------------------------------------------
    def end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq`; its blocks are freed once no step on the device writes to them."""
        in_flight = any(f.holds(seq) for f in self.inflight)
        self.scheduler.finish(seq, reason, in_flight)

    def append_token(
        self,
        request: Request,
        seq: Sequence,
        token: int,
        logprobs: PositionLogprobs | None = None,
    ) -> StepDelta:
        """Output one sampled token for `seq` (a choice of `request`); its delta, which may end
        the choice (EOS, stop ids and strings, max_tokens, the context)."""
        try:
            delta = request.add_token(seq, token, self.eos_token_ids, self.max_model_len, logprobs)
        except RequestFailed as failure:
            return self._fail(request, seq, failure.error)
        if delta.finish_reason is not None:
            self.end(seq, delta.finish_reason)
        return delta

    def _fail(self, request: Request, seq: Sequence, error: RequestError) -> StepDelta:
        """End every choice of `request` with finish_reason "error" (its blocks freed as for any
        other end); the batch runs on. The delta is `seq`'s."""
        log.warning("request %s ended early: %s", seq.request_id, error.message)
        request.error = error
        for choice in request.choices:
            if not choice.seq.is_finished:
                self.end(choice.seq, "error")
        return StepDelta(seq.request_id, [], "", "error", index=seq.index)
