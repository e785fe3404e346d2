"""The router: validates and tokenizes once, dispatches to a decode worker and relays its
tokens, moving the request to another worker if its worker is lost. Shared by the gRPC API and
the HTTP gateway.

A request's path: `Validator.validate` (pdmesh.validation) -> `Router.generate`, which loops
over attempts: `Dispatcher.submit` -> `Attempt.relay` (dispatch.py) until a chunk carries a
finish reason; a lost worker hands the request to `Failover`, which re-submits prompt + the
tokens already streamed.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdmesh.checkpoint.config import ModelConfig
from pdmesh.checkpoint.source import model_display_name
from pdmesh.errors import InvalidRequest, Unavailable
from pdmesh.logger import get_logger
from pdmesh.router import metrics
from pdmesh.router.choices import resume_choices
from pdmesh.router.config import RouterConfig
from pdmesh.router.decode_link import LinkLost
from pdmesh.router.dispatch import Dispatcher
from pdmesh.router.planner.loop import Planner
from pdmesh.router.planner.slo import SloWindow
from pdmesh.router.registry import WorkerRegistry
from pdmesh.router.request_telemetry import RequestTelemetry
from pdmesh.router.roles import RoleSwitcher
from pdmesh.router.stream_pacing import StreamPacer
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import worker_pb2
from pdmesh.validation import Validator, ValidRequest

log = get_logger(__name__)


@dataclass
class Failover:
    """What moving a request to another decode worker needs: every token streamed to the client
    so far (the next worker gets them appended to the prompt, counted as output, so the stream
    goes on without a gap or a repeat) and the workers lost so far."""

    request_id: str
    max_failovers: int
    sent: list[int] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)  # lost or drained: avoided
    failovers: int = 0
    workers_lost: int = 0  # decode workers lost while serving it (not drained ones)

    def worker_lost(self, gone: LinkLost, telemetry: RequestTelemetry) -> None:
        """Note the loss; Unavailable once the request has moved `max_failovers` times."""
        self.lost.add(gone.address)
        self.workers_lost += 1
        if self.failovers >= self.max_failovers:
            raise Unavailable(
                f"decode worker {gone.address} was lost mid-request ({gone.detail}), "
                f"after {self.failovers} failovers."
            )
        self.failovers += 1
        telemetry.failover("worker_lost")
        log.warning(
            "decode worker %s lost request %s after %d tokens (%s); moving it",
            gone.address,
            self.request_id,
            len(self.sent),
            gone.detail,
        )

    def drained(
        self, address: str, handle: str, telemetry: RequestTelemetry
    ) -> worker_pb2.MigrateFrom | None:
        """The request's decode worker drains and handed it over (not a failure: no failover
        is spent): that worker is avoided from now on. Where the next one pulls the request's
        KV from, or None when it computes it (no handle, or nothing sent yet)."""
        self.lost.add(address)
        telemetry.failover("migrated" if handle else "drained")
        if not handle or not self.sent:
            return None
        return worker_pb2.MigrateFrom(address=address, handle=handle)


class Router:
    """The workers of `config` (registry, dispatch policy) and the validator of the model whose
    config and tokenizer are given."""

    def __init__(self, config: RouterConfig, info: ModelConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.info = info
        self.model_name = config.served_model_name or model_display_name(config.model)
        self.max_model_len = config.max_model_len or info.max_position
        self.validator = Validator(self.model_name, info.vocab_size, self.max_model_len, tokenizer)
        self.registry = WorkerRegistry(config)
        self.dispatcher = Dispatcher(config, self.registry)
        self.roles = RoleSwitcher(self.registry, self.dispatcher)  # by hand, or the planner
        self.pacer = StreamPacer()
        self._active_ids: set[str] = set()  # client request ids in flight
        # With the planner: TTFT and inter-token latency against its SLO, and the planner.
        self.slo: SloWindow | None = None
        self.planner: Planner | None = None
        if config.planner is not None:
            self.slo = SloWindow(config.planner.slo_ttft_s, config.planner.slo_itl_s)
            self.planner = Planner(
                config.planner, self.registry, self.dispatcher, self.roles, self.slo
            )

    def start(self) -> None:
        self.registry.start()
        self.dispatcher.start()
        if self.planner is not None:
            self.planner.start()

    async def close(self) -> None:
        if self.planner is not None:
            await self.planner.close()
        await self.dispatcher.close()
        await self.registry.close()
        self.validator.close()

    async def generate(self, inp: ValidRequest) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The request's chunks; the last has a finish reason, usage and timings. Raises
        `pdmesh.errors` classes: InvalidRequest (its id is in use), Overloaded / Unavailable (no
        worker took it, or its workers were lost), or what its decode worker reported."""
        if inp.request_id in self._active_ids:
            raise InvalidRequest(
                f"request_id {inp.request_id!r} is already in use by a request.", "request_id"
            )
        telemetry = RequestTelemetry(
            inp.request_id, len(inp.prompt), inp.params, self.config.policy
        )
        failover = Failover(inp.request_id, self.config.max_failovers)
        self._active_ids.add(inp.request_id)
        self.pacer.open += 1
        finished = False
        clock = self.slo.clock() if self.slo is not None else None
        try:
            async for chunk in self._run(inp, failover, telemetry):
                if clock is not None:
                    clock.tokens(len(chunk.token_ids))
                finished = chunk.HasField("usage")  # before the yield: the client may leave
                yield chunk
        except Exception:
            if failover.workers_lost:
                metrics.request_failed_worker_lost()
            raise
        finally:
            self._active_ids.discard(inp.request_id)
            telemetry.end(finished)
            self.pacer.open -= 1

    async def _run(
        self, inp: ValidRequest, failover: Failover, telemetry: RequestTelemetry
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Attempts until the request's last chunk: after a lost worker, the next attempt
        submits prompt + the tokens already sent. A request of several choices that had
        streamed some is continued choice by choice (choices.py); before any, it starts over."""
        single = inp.params.num_sequences == 1
        sent: dict[int, list[int]] = {i: [] for i in range(inp.params.num_sequences)}
        if single:
            sent[0] = failover.sent  # extended in place as tokens go out
        ended: set[int] = set()
        migrate_from = None  # after a drained worker handed the request over
        while True:
            tokens = sent[0] if single else []
            attempt = await self.dispatcher.submit(
                inp, tokens, failover.lost, telemetry, migrate_from
            )
            try:
                async for chunk in attempt.relay(self.pacer):
                    sent[chunk.index] += chunk.token_ids
                    if chunk.finish_reason:
                        ended.add(chunk.index)
                    yield chunk
            finally:
                self.dispatcher.end(attempt)
            if attempt.moved is not None:
                address = attempt.decode.address
                migrate_from = failover.drained(address, attempt.moved, telemetry)
            elif attempt.lost is None:
                return
            else:
                migrate_from = None
                failover.worker_lost(attempt.lost, telemetry)
            if single or not any(sent.values()):
                continue
            run = functools.partial(self._run_choice, failover, telemetry)
            async for chunk in resume_choices(inp, sent, ended, run):
                yield chunk
            return

    def _run_choice(
        self, failover: Failover, telemetry: RequestTelemetry, inp: ValidRequest, sent: list[int]
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """One choice of a request whose worker was lost, continued as a request of its own
        with the failovers the request has left."""
        left = failover.max_failovers - failover.failovers
        return self._run(inp, Failover(inp.request_id, left, sent, set(failover.lost)), telemetry)
