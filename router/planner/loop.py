"""The planner's loop in the router: every interval it gathers an `Observation` from what the
router already knows (its registry's workers and their last stats, the prefill tokens it sent
each prefill worker, the prefill rate and SLO attainment it measures), asks the policy, and
carries out a switch through `RoleSwitcher` (router/roles.py), the path of `pdmesh role`: a
decode worker's running requests move with their KV, a prefill worker finishes its prefills.

While a switch runs the loop waits for it; then the attainment measured during the switch is
dropped and the next interval starts afresh (as Dynamo's planner pauses while it scales).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import Counter, Gauge

from pdmesh.errors import PdmeshError
from pdmesh.logger import get_logger
from pdmesh.router.dispatch import Dispatcher
from pdmesh.router.planner.config import PlannerConfig
from pdmesh.router.planner.policy import Observation, PlanningPolicy, Switch, WorkerView
from pdmesh.router.planner.slo import SloWindow
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.router.roles import RoleSwitcher

log = get_logger(__name__)

# Default registry, beside router/metrics.py's, served at the router's /metrics.
PLANNER_SWITCHES = Counter(
    "pdmesh_router_planner_switches",
    "Role switches the planner made, by the role taken and why: prefill_starved, "
    "decode_starved, idle (back to the starting split).",
    ["to_role", "reason"],
)
PLANNER_FAILED = Counter(
    "pdmesh_router_planner_switches_failed",
    "Role switches the planner asked for that were refused or failed.",
    ["to_role"],
)
SLO_ATTAINMENT = Gauge(
    "pdmesh_router_slo_attainment",
    "Share within the planner's SLO over its last interval with samples: ttft (requests' first "
    "token), itl (tokens after the first).",
    ["kind"],
)


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        switcher: RoleSwitcher,
        slo: SloWindow,
    ) -> None:
        self.config = config
        self.registry = registry
        self.dispatcher = dispatcher
        self.switcher = switcher
        self.slo = slo
        self.policy = PlanningPolicy(config)
        # The split the operator started with: where the planner returns when the mesh is idle.
        self.home = {w.address: w.role for w in registry.workers}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                switch = self.policy.decide(self.observe())
                if switch is not None:
                    await self.apply(switch)
                    self.slo.take()  # measured while the mesh was changing: not the new split's
            except Exception:  # a bug: logged, and the planner goes on
                log.exception("planner: the interval failed")

    def observe(self) -> Observation:
        attainment = self.slo.take()
        if attainment.ttft is not None:
            SLO_ATTAINMENT.labels("ttft").set(attainment.ttft)
        if attainment.itl is not None:
            SLO_ATTAINMENT.labels("itl").set(attainment.itl)
        bs = self.dispatcher.block_size
        prefill = tuple(self._view(w, bs) for w in self.registry.healthy("prefill"))
        decode = tuple(self._view(w, bs) for w in self.registry.healthy("decode"))
        # A prompt sent now goes to the least queued prefill worker.
        queued = min((w.queued_tokens for w in prefill), default=0)
        return Observation(
            time.monotonic(),
            prefill,
            decode,
            attainment.ttft,
            attainment.itl,
            self.dispatcher.prefill_rate.queue_wait_s(queued) if prefill else None,
        )

    def _view(self, w: Worker, block_size: int) -> WorkerView:
        load = w.load
        return WorkerView(
            w.address,
            w.role,
            self.home.get(w.address, w.role),
            len(w.roles) > 1,
            queued_tokens=w.inflight_blocks * block_size if w.role == "prefill" else 0,
            kv_used=load.kv_blocks_used,
            kv_total=load.kv_blocks_total,
            running=load.num_running,
            waiting=load.num_waiting,
        )

    async def apply(self, switch: Switch) -> None:
        log.info("planner: %s: switching %s to %s", switch.reason, switch.worker, switch.to_role)
        try:
            reply = await self.switcher.set_role(switch.worker, switch.to_role)
        except PdmeshError as e:
            PLANNER_FAILED.labels(switch.to_role).inc()
            log.warning("planner: %s stays as it was: %s", switch.worker, e)
            return
        PLANNER_SWITCHES.labels(switch.to_role, switch.reason).inc()
        log.info(
            "planner: %s serves %s (%d requests moved with their KV, %d recomputed, %d prefills "
            "finished first)",
            switch.worker,
            reply.role,
            reply.migrated,
            reply.recomputed,
            reply.prefills_finished,
        )
