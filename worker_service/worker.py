"""A worker that takes either role: a decode worker that also serves Prefill calls over the same
engine, and switches between the two when the router asks (`WorkerRole.SetRole`).

Its role decides what it accepts: Submits (decode) or Prefill calls (prefill); the other is
refused with UNAVAILABLE, which the router and decode workers handle as a busy or lost peer.
A switch from decode to prefill first moves the running requests to other decode workers with
their KV (the drainer's live migration, decode_service/drain.py), so no stream loses or repeats
a token; one from prefill to decode first finishes the prefills under way. Switches run one at
a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from pdmesh.decode_service.types import Submission
from pdmesh.decode_service.worker import DecodeWorker
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import StepDelta
from pdmesh.errors import InvalidRequest, Unavailable
from pdmesh.kv_transfer.push_receive_connector import PushReceiveConnector
from pdmesh.kv_transfer.stats import ReceiverStats, SenderStats
from pdmesh.logger import get_logger
from pdmesh.observability.worker_collector import WorkerSnapshot
from pdmesh.prefill_service.metrics import PrefillMetrics
from pdmesh.prefill_service.worker import Prefills
from pdmesh.worker_service.config import ROLES, WorkerConfig, check_role

log = get_logger(__name__)


@dataclass(frozen=True)
class RoleChange:
    """What a switch did (the fields of a SetRoleReply)."""

    role: str
    previous: str = ""  # "" when the worker had that role already
    migrated: int = 0  # decode -> prefill: requests moved with their KV
    recomputed: int = 0  # ... and without it
    prefills_finished: int = 0  # prefill -> decode: Prefill calls it waited for


class RoleWorker(DecodeWorker):
    """Rank 0 of a worker that takes either role. `role` is the one it serves now."""

    def __init__(
        self, config: WorkerConfig, connector: PushReceiveConnector, engine: LLMEngine
    ) -> None:
        super().__init__(config, connector, engine)
        self.role = config.role  # shadows the class's "decode"
        self.push = connector.push
        # The prefill role's timings, on this worker's /metrics (its KV pushes are counted with
        # the receiver's, by direction).
        prefill_metrics = PrefillMetrics(self.metrics_snapshot)
        for histogram in (prefill_metrics.prefill, prefill_metrics.queue):
            self.metrics.registry.register(histogram)
        self.requests = Prefills(self, connector.push, prefill_metrics, config.kv_send_timeout_s)
        self.requests.accepting = self.role == "prefill"
        self._switching = asyncio.Lock()

    async def set_role(self, role: str) -> RoleChange:
        """Take `role` once the old one's work is done here (see the module's docstring)."""
        try:
            check_role(role)
        except ValueError as e:
            raise InvalidRequest(str(e), "role") from None
        async with self._switching:
            previous = self.role
            if role == previous:
                return RoleChange(role)
            log.info("switching from %s to %s", previous, role)
            try:
                if role == "prefill":
                    moved = await self.drainer.evacuate()  # refuses Submits meanwhile
                    change = RoleChange(role, previous, moved.migrated, moved.recomputed)
                else:
                    finished = await self.requests.finish()  # refuses Prefill calls meanwhile
                    change = RoleChange(role, previous, prefills_finished=finished)
                self.role = role
            finally:  # switched, or (the call cancelled) back to taking the old role's work
                if role == "prefill":
                    self.drainer.draining = False
                self.requests.accepting = self.role == "prefill"
            log.info("now serving %s: %s", role, change)
            return change

    async def drain(self) -> None:
        """SIGTERM with --drain-on-sigterm: the prefills under way end, the running requests
        move to other decode workers; then the worker exits."""
        await self.requests.finish()
        await self.drainer.drain()

    async def submit(self, sub: Submission) -> None:
        if self.role != "decode":
            raise Unavailable("this worker serves prefill now; submit to a decode worker.")
        await super().submit(sub)

    def _on_engine_deltas(self, deltas: list[StepDelta]) -> None:
        prefills = [d for d in deltas if self.requests.owns(d.request_id)]
        if prefills:
            deltas = [d for d in deltas if not self.requests.owns(d.request_id)]
            self.requests.on_deltas(prefills)
        if deltas:
            super()._on_engine_deltas(deltas)

    # -- figures ------------------------------------------------------------------------------
    def transfer_stats(self) -> list[tuple[str, SenderStats | ReceiverStats]]:
        return [*super().transfer_stats(), *self.push.stats_by_transport().items()]

    def metrics_snapshot(self) -> WorkerSnapshot:
        return dataclasses.replace(super().metrics_snapshot(), role=self.role)

    async def report(self) -> dict[str, Any]:
        fields = await super().report()
        # Pushed in its prefill role (rank 0's heads; received is every rank's).
        sent = self.push.bytes_here()
        return {**fields, "role": self.role, "roles": list(ROLES), "kv_bytes_sent": sent}
