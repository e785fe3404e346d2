"""Rank 0 of a tensor- or pipeline-parallel worker: starts the follower ranks and drives them.

Rank 0 hosts the store the ranks meet at; a launcher (engine/executor/, picked by
`distributed_executor_backend`) starts the followers from a JSON spec: local processes
(`python -m pdmesh.engine.executor.follower`) that die with rank 0, the same over several nodes
(a static launch), or Ray actors. Each step rank 0 broadcasts the flat step inputs and the KV
connector's plan; every rank runs the same forward on its shard. Between steps rank 0 sends
control messages (`pdmesh.kv_transfer.connector`'s codec: typed, JSON, a follower's failure
raised here). A follower that dies, on any node, is noticed by a monitor thread within a
fraction of a second; the worker then reports it and goes down.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.executor import step_codec
from pdmesh.engine.executor.base import FollowerSpec, create_launcher
from pdmesh.engine.executor.profiling import span
from pdmesh.engine.parallel.comm import (
    broadcast_bytes,
    destroy,
    gather_bytes,
    init_group,
    serve_store,
    tp_group,
)
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.pipeline import PipelineStage, stage_of
from pdmesh.engine.parallel.step_channel import StepChannel
from pdmesh.engine.runner.step_inputs import StepInputs
from pdmesh.kv_transfer.connector import control_message, decode, encode, raise_failures
from pdmesh.logger import get_logger

log = get_logger(__name__)

OP_STEP, OP_CONTROL, OP_STOP = 1, 2, 3
MONITOR_INTERVAL_S = 0.2


@control_message
class CountExperts:
    """Asks a follower for the tokens its MoE layers routed to each expert (`ExpertCounts`)."""


@control_message
class ExpertCounts:
    counts: tuple[int, ...]


def rank_device(base: torch.device, rank: int) -> torch.device:
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + rank)
    return base


def init_ranks(
    rank: int,
    config: EngineConfig,
    init_method: str,
    device: torch.device,
    num_layers: int,
    store: dist.Store | None = None,
) -> tuple[ParallelGroup, ParallelGroup, PipelineStage]:
    """Join the worker's ranks from `device`, this rank's own: (every rank, this rank's TP
    group, its pipeline stage). `store`: rank 0's."""
    ep = config.enable_expert_parallel
    world = init_group(rank, config.world_size, init_method, device, ep, store)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    return world, tp_group(world, tp), stage_of(rank, tp, pp, num_layers, world)


class StepOutbox:
    """Rank 0's step broadcasts, in order, on a thread of their own: a gloo broadcast returns
    only once every rank has received it. Host integers only: a step launched ahead of its
    input ids (async scheduling) keeps them on rank 0's device, where stage 0 reads them; that
    needs stages of one rank (`ids_stay`): no follower embeds tokens then."""

    def __init__(self, group: ParallelGroup, channel: StepChannel, ids_stay: bool) -> None:
        self.group, self.channel = group, channel
        self.ids_stay = ids_stay
        self._queue: queue.Queue[tuple[StepInputs, torch.Tensor | None]] = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="step-outbox", daemon=True).start()

    def put(self, inputs: StepInputs, plan: torch.Tensor | None) -> None:
        self._raise()
        if len(inputs.host.input_ids) != inputs.host.num_tokens and not self.ids_stay:
            raise RuntimeError("pipeline stages of several ranks take their input ids on the host")
        self._queue.put((inputs, plan))

    def drain(self) -> None:
        """Until every step put is sent (the error of one that failed raised here)."""
        self._queue.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending a step to the other ranks failed: {self._error}")

    def _run(self) -> None:
        while True:
            inputs, plan = self._queue.get()
            try:
                if self._error is None:
                    step_codec.send(
                        OP_STEP, inputs, plan, self.group, self.channel, ids_travel=False
                    )
            except BaseException as e:  # raised on the engine thread at the next put or drain
                self._error = e
            finally:
                self._queue.task_done()


class TPDriver:
    """Rank 0's side of the followers: `send_step` and `call` on the engine thread (or before it
    starts); `on_rank_death(message)` is called from the monitor thread."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        num_layers: int,
        connector_options: object | None = None,
    ) -> None:
        """num_layers: the model's decoder layers (split over pipeline stages).
        connector_options: what each follower builds its KV connector from (None: none)."""
        self.launcher = create_launcher(config)
        host, port = self.launcher.rendezvous()
        store = serve_store(host, port)
        init_method = f"tcp://{host}:{store.port}"
        engine = dataclasses.asdict(config)
        # The base device: rank r of this node runs on cuda:(index + r).
        spec = FollowerSpec(engine, init_method, str(device), encode(connector_options).decode())
        self.on_rank_death: Callable[[str], None] | None = None
        self.dead: str | None = None  # why the worker cannot go on: a rank stopped
        self._stopping = False
        try:
            self.launcher.start(spec, store)
        except BaseException:
            self.launcher.stop(0)
            raise
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        # `group`: every rank (steps and control go to all); `tp`, `stage`: rank 0's own.
        self.group: ParallelGroup
        self.group, self.tp, self.stage = init_ranks(
            0, config, init_method, rank_device(device, 0), num_layers, store
        )
        # Where each step's first message goes (shared memory with followers on this machine).
        self.channel = StepChannel(self.group, step_codec.FIRST_LEN)
        self.channel.check_followers = self._check_alive
        # With pipeline stages a step's broadcast waits for a later stage still busy with an
        # earlier batch: it runs on a thread of its own while rank 0 computes its stage.
        self._outbox = None
        if self.stage.size > 1:
            self._outbox = StepOutbox(self.group, self.channel, ids_stay=self.stage.tp_size == 1)

    def send_step(self, inputs: StepInputs, plan: torch.Tensor | None) -> None:
        """The step's inputs and KV plan to every follower, before rank 0 runs it."""
        self._check_alive()
        if self._outbox is None:
            with span("driver.send_step"):
                step_codec.send(OP_STEP, inputs, plan, self.group, self.channel)
        else:
            self._outbox.put(inputs, plan)

    def call(self, message: object) -> list[object | None]:
        """Run a control message on every follower (between steps); their replies, rank 1
        first. A follower's failure is raised here as its kind (see `raise_failures`)."""
        self._check_alive()
        if self._outbox is not None:
            self._outbox.drain()
        step_codec.send_op(OP_CONTROL, self.channel)
        broadcast_bytes(encode(message), self.group)
        replies = gather_bytes(b"", self.group)
        return raise_failures([decode(r) for r in replies[1:]])

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"this worker lost a rank ({self.dead}); start it again")

    def _watch(self) -> None:
        while not self._stopping:
            try:
                message = self.launcher.poll()
            except Exception as e:  # e.g. a Ray cluster gone: the ranks cannot be trusted
                message = f"watching the ranks failed: {e}"
            if message is not None and not self._stopping:
                log.error(message)
                self.dead = message
                if self.on_rank_death is not None:
                    self.on_rank_death(message)
                return
            time.sleep(MONITOR_INTERVAL_S)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            if self.dead is None and self.launcher.poll() is None:
                if self._outbox is not None:
                    self._outbox.drain()
                step_codec.send_op(OP_STOP, self.channel)
        except RuntimeError as e:
            log.warning("could not stop the followers cleanly: %s", e)
        # NCCL tears a communicator down with all its ranks (ncclCommFinalize and ncclCommDestroy
        # wait for the peers), and the followers do so as soon as they are told to stop: rank 0
        # tears down beside them. Torn down only after they exited, it waited out the launcher's
        # timeout while they waited for it, then killed them (10 s a rank on two H100s).
        teardown = threading.Thread(target=destroy, name="tp-teardown", daemon=True)
        teardown.start()
        self.launcher.stop(timeout_s)
        teardown.join(timeout_s)
        if teardown.is_alive():
            log.warning("the process groups were not torn down within %.0f s", timeout_s)
