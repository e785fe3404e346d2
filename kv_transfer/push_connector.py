"""The prefill worker's KV connector: every rank pushes its heads of a prompt's blocks, layer by
layer while the forward runs, to the decode ranks that hold them (see pusher.py).

Rank 0 plans each step (`plan_step`): for every prompt with a transfer, the prompt blocks whose
K/V this step completes. Rank 0 tells its followers about transfers in control messages
(`PushStart`, `PushEnd`, `PushAbort`, `CountSent`).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from pdmesh.kv_transfer.base import PageGeometry, TransferError, TransferStats
from pdmesh.kv_transfer.connector import (
    ControlChannel,
    Count,
    KVBinding,
    KVConnector,
    StepBatch,
    control_message,
    register_connector,
)
from pdmesh.kv_transfer.pusher import ALL_LAYERS, ONE_LAYER, KVPusher
from pdmesh.kv_transfer.stats import SenderStats
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger

log = get_logger(__name__)


@control_message
class PushOptions:
    """A push connector needs no settings: senders are made per transport on first use."""


@control_message
class PushStart:
    job_id: int
    target: KVTarget


@control_message
class PushEnd:
    job_id: int
    timeout_s: float


@control_message
class PushAbort:
    job_id: int


@control_message
class CountSent:
    """Asks a follower for its KV bytes sent; it replies `Count`."""


@dataclass
class PushJob:
    """One prompt's push, as rank 0 plans it (engine thread)."""

    job_id: int
    request_id: str
    first_block: int
    end_block: int
    sent: int  # the next prompt block to push
    forward_ns: int = 0  # unix ns of the first forward step that ran this prompt


@register_connector(PushOptions)
class PushConnector(KVConnector):
    """Callers may rely on: `check` and `geometry` once bound; `start`, `finish_followers`,
    `abort`, `forget` and `bytes_sent` on the engine thread; `done`, `finish` and the stats from
    any thread (`finish` blocks until the rank 0 sends are acknowledged)."""

    def __init__(self, options: PushOptions | None = None) -> None:
        self.options = options or PushOptions()
        self._pusher: KVPusher | None = None
        self._followers: ControlChannel | None = None
        self._jobs: dict[str, PushJob] = {}  # request id -> its push (engine thread)
        self._job_ids = itertools.count(1)

    @property
    def pusher(self) -> KVPusher:
        if self._pusher is None:
            raise RuntimeError("the KV connector is not bound to an engine yet")
        return self._pusher

    @property
    def geometry(self) -> PageGeometry:
        return self.pusher.geometry

    def check(self, transport: str) -> None:
        """ValueError unless this worker can push over `transport`."""
        self.pusher.check(transport)

    # -- rank 0, engine thread ----------------------------------------------------------------
    def start(self, request_id: str, target: KVTarget) -> PushJob:
        """Open the sends of every rank; the prompt's blocks go as steps complete them."""
        job = PushJob(
            next(self._job_ids),
            request_id,
            target.first_block,
            target.first_block + target.num_blocks,
            target.first_block,
        )
        self.pusher.start(job.job_id, target)
        try:
            if self._followers is not None:
                self._followers.call(PushStart(job.job_id, target))
        except BaseException:
            self.pusher.abort(job.job_id)
            raise
        self._jobs[request_id] = job
        return job

    def forget(self, request_id: str) -> None:
        """The prompt is computed (or aborted): nothing more to plan for it."""
        self._jobs.pop(request_id, None)

    def finish_followers(self, job: PushJob, timeout_s: float) -> None:
        """The followers finish their sends in the background: the decode worker checks that
        every rank's heads arrived."""
        if self._followers is not None:
            self._followers.call(PushEnd(job.job_id, timeout_s))

    def abort(self, job: PushJob) -> None:
        self.forget(job.request_id)
        self.pusher.abort(job.job_id)
        if self._followers is not None:
            self._followers.call(PushAbort(job.job_id))

    def bytes_sent(self) -> int:
        """Over every rank."""
        sent = self.pusher.stats.bytes_sent
        if self._followers is not None:
            sent += sum(r.value for r in self._followers.call(CountSent()))  # type: ignore[union-attr]
        return sent

    @property
    def has_followers(self) -> bool:
        return self._followers is not None

    # -- rank 0, any thread -------------------------------------------------------------------
    def done(self, job: PushJob) -> bool:
        return self.pusher.done(job.job_id)

    def finish(self, job: PushJob, timeout_s: float) -> list[TransferStats]:
        """Wait until rank 0's frames are acknowledged (TransferError if they are not)."""
        return self.pusher.finish(job.job_id, timeout_s)

    @property
    def stats(self) -> SenderStats:
        """Rank 0's counters over its transports (thread-safe)."""
        return self.pusher.stats

    def stats_by_transport(self) -> dict[str, SenderStats]:
        return self.pusher.stats_by_transport()

    # -- the connector interface --------------------------------------------------------------
    @property
    def plans_steps(self) -> bool:
        return True

    def plan_step(self, batch: StepBatch) -> torch.Tensor | None:
        bs = self.geometry.block_size
        items: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            job = self._jobs.get(seq.request_id)
            if job is None:
                continue
            if not job.forward_ns:
                job.forward_ns = time.time_ns()
            # Blocks complete before this step (cached here): every layer at once.
            cached = min(seq.num_computed_tokens // bs, job.end_block)
            if cached > job.sent:
                ids = seq.block_table[job.sent : cached]
                items += [job.job_id, job.sent - job.first_block, len(ids), ALL_LAYERS, *ids]
                job.sent = cached
            end = seq.num_computed_tokens + n
            # Blocks whose K/V this step completes; the prompt's last one may be partial.
            upto = job.end_block if end >= seq.num_prompt_tokens else min(end // bs, job.end_block)
            if upto <= job.sent:
                continue
            ids = seq.block_table[job.sent : upto]
            items += [job.job_id, job.sent - job.first_block, len(ids), ONE_LAYER, *ids]
            job.sent = upto
        return torch.tensor(items, dtype=torch.int64) if items else None

    def bind(self, binding: KVBinding) -> None:
        self._pusher = KVPusher(binding)
        self._followers = binding.followers

    def start_step(self, plan: torch.Tensor) -> None:
        self.pusher.bind_plan(plan)

    def save_layer(self, layer: int) -> None:
        self.pusher.push_layer(layer)

    def end_step(self) -> None:
        self.pusher.unbind_plan()

    def handle(self, message: object) -> object | None:
        match message:
            case PushStart(job_id, target):
                self.pusher.start(job_id, target)
            case PushEnd(job_id, timeout_s):
                # Rank 0 does not wait: the decode worker checks that every rank's heads arrived.
                threading.Thread(target=self._finish, args=(job_id, timeout_s), daemon=True).start()
            case PushAbort(job_id):
                self.pusher.abort(job_id)
            case CountSent():
                return Count(self.pusher.stats.bytes_sent)
            case _:
                return super().handle(message)
        return None

    def _finish(self, job_id: int, timeout_s: float) -> None:
        try:
            self.pusher.finish(job_id, timeout_s)
        except TransferError as e:
            log.warning("KV push of job %d failed on this rank: %s", job_id, e)

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()
