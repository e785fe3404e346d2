"""The prefill worker's KV connector: every rank pushes its heads of its layers of a prompt's
blocks, layer by layer while the forward runs, to the decode ranks that hold them (pipeline
stages: each prefill stage sends its layers to the decode ranks holding those layers, so with
any two layouts every byte crosses once, rank to rank).

Rank 0 plans each step (`plan_step`): for every prompt with a transfer, the prompt blocks whose
K/V this step completes. The plan (flat int64: job, first transfer block, n, layers, then n
block ids, repeated) travels with the step to every rank; after each layer, each rank sends its
own KV heads of those blocks. Blocks complete before the step (a prompt prefix this worker had
cached) are planned with layers = ALL_LAYERS and go at once, every layer, right after the first
layer (`KVSender.send_layers`: a transport may send several layers as one message), rather than
at the pace of a short forward. Rank 0 tells its followers about transfers in control messages
(`PushStart`, `PushEnd`).

The decode worker names the transport of each transfer (it is chosen per pair); every rank
keeps one sender per transport it was asked for, made on first use.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from pdmesh.kv_transfer.base import (
    KVSender,
    SendHandle,
    TransferError,
    TransferStats,
)
from pdmesh.kv_transfer.connector import (
    KVConnector,
    StepBatch,
    control_message,
    register_connector,
)
from pdmesh.kv_transfer.registry import check_transport, create_sender
from pdmesh.kv_transfer.stats import SenderStats, total_stats
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger

log = get_logger(__name__)
# A plan item's `layers`: ONE_LAYER = blocks this step completes, pushed after each layer;
# ALL_LAYERS = blocks complete before it, every layer pushed at once after the first.
ONE_LAYER, ALL_LAYERS = 1, 0


@control_message
class PushOptions:
    """A push connector needs no settings: senders are made per transport on first use."""


@control_message
class PushStart:
    job_id: int
    target: KVTarget


@control_message
class PushEnd:
    """A follower finishes the job's sends in the background, or drops them (timeout_s None)."""

    job_id: int
    timeout_s: float | None


def start_sends(
    sender: KVSender, target: KVTarget, heads: range, layers: range
) -> list[SendHandle]:
    """A send handle to every endpoint of `target` that holds any of this rank's KV `heads` in
    its `layers` (global indices), each told which of them it receives."""
    return [
        sender.start(
            e.address,
            target.transfer_id,
            target.token,
            target.num_blocks,
            (e.head_start, e.num_heads),
            (e.layer_start, e.num_layers) if e.num_layers else None,
        )
        for e in target.endpoints
        if e.overlaps(heads, layers)
    ]


@dataclass
class PushJob:
    """One prompt's push, as rank 0 plans it (engine thread)."""

    job_id: int
    request_id: str
    first_block: int
    end_block: int
    sent: int  # the next prompt block to push
    forward_ns: int = 0  # unix ns of the first forward step that ran this prompt


@dataclass
class _Sends:
    """One job's sends from this rank."""

    job_id: int
    sender: KVSender
    handles: list[SendHandle]
    broken: bool = False


@register_connector(PushOptions)
class PushConnector(KVConnector):
    """Callers may rely on: `check` once bound; `start`, `end`, `forget` and `bytes_moved` on the
    engine thread; `done`, `finish` and the stats from any thread (`finish` blocks until this
    rank's frames are acknowledged)."""

    plans_steps = True

    def __init__(self, options: PushOptions | None = None) -> None:
        self.options = options or PushOptions()
        self._senders: dict[str, KVSender] = {}
        self._sends: dict[int, _Sends] = {}  # job id -> this rank's sends
        self._pushes: list[tuple[_Sends, int, int, torch.Tensor]] = []  # the bound plan, parsed
        self._jobs: dict[str, PushJob] = {}  # rank 0: request id -> its push (engine thread)
        self._job_ids = itertools.count(1)

    def check(self, transport: str) -> None:
        """ValueError unless this worker can push over `transport`."""
        check_transport(transport, self.binding.cache.device)

    # -- rank 0, engine thread ----------------------------------------------------------------
    def start(self, request_id: str, target: KVTarget) -> PushJob:
        """Open the sends of every rank; the prompt's blocks go as steps complete them."""
        first = target.first_block
        job = PushJob(next(self._job_ids), request_id, first, first + target.num_blocks, first)
        self._open(job.job_id, target)
        try:
            self.tell_followers(PushStart(job.job_id, target))
        except BaseException:
            self._abort(job.job_id)
            raise
        self._jobs[request_id] = job
        return job

    @property
    def pushing(self) -> bool:
        """Rank 0, engine thread: some prompt's push is planned."""
        return bool(self._jobs)

    def forget(self, request_id: str) -> None:
        """The prompt is computed (or aborted): nothing more to plan for it."""
        self._jobs.pop(request_id, None)

    def end(self, job: PushJob, timeout_s: float | None) -> None:
        """The followers finish their sends in the background (the decode worker checks that
        every rank's heads arrived), or with timeout_s None every rank drops them."""
        if timeout_s is None:
            self.forget(job.request_id)
            self._abort(job.job_id)
        self.tell_followers(PushEnd(job.job_id, timeout_s))

    # -- rank 0, any thread -------------------------------------------------------------------
    def done(self, job: PushJob) -> bool:
        """Every send of the job is done: `finish` returns at once."""
        sends = self._sends.get(job.job_id)
        return (
            sends is not None
            and not sends.broken
            and all(sends.sender.done(h) for h in sends.handles)
        )

    def finish(self, job_id: int, timeout_s: float) -> list[TransferStats]:
        """Wait until this rank's frames are acknowledged (TransferError if they are not)."""
        sends = self._sends.pop(job_id)
        return [sends.sender.finish(h, timeout_s) for h in sends.handles]

    @property
    def stats(self) -> SenderStats:
        """This rank's counters over its transports (thread-safe)."""
        return total_stats(SenderStats, self.stats_by_transport().values())

    def stats_by_transport(self) -> dict[str, SenderStats]:
        """Any thread: a sender made meanwhile on the engine thread is counted next time."""
        return {name: s.stats for name, s in list(self._senders.items())}

    def bytes_here(self) -> int:
        return self.stats.bytes_sent

    # -- every rank ---------------------------------------------------------------------------
    def _open(self, job_id: int, target: KVTarget) -> None:
        sender = self._senders.get(target.transport)
        if sender is None:
            self.check(target.transport)
            sender = create_sender(target.transport, self.geometry)
            self._senders[target.transport] = sender
        heads = self.binding.heads
        mine = range(heads.start, heads.start + heads.count)
        handles = start_sends(sender, target, mine, self.geometry.layers) if heads.sends else []
        self._sends[job_id] = _Sends(job_id, sender, handles)

    def _abort(self, job_id: int) -> None:
        sends = self._sends.pop(job_id, None)
        for h in sends.handles if sends is not None else ():
            sends.sender.abort(h)

    # -- the connector interface --------------------------------------------------------------
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

    def start_step(self, plan: torch.Tensor) -> None:
        """Parse the plan once: (sends, first transfer block, layers, block ids on the cache's
        device). The ids are copied without a sync: a blocking copy in a layer hook would make
        the host wait for the GPU at every layer."""
        cache = self.binding.cache
        items = plan.tolist() if plan.numel() else []
        pushes = []
        i = 0
        while i < len(items):
            job_id, offset, n, layers = items[i : i + 4]
            ids = torch.tensor(items[i + 4 : i + 4 + n], dtype=torch.int64)
            i += 4 + n
            sends = self._sends.get(job_id)
            if sends is None or sends.broken or not sends.handles:
                continue
            if cache.is_cuda:
                ids = ids.pin_memory().to(cache.device, non_blocking=True)
            pushes.append((sends, offset, layers, ids))
        self._pushes = pushes

    def save_layer(self, layer: int) -> None:
        cache = self.binding.cache  # [L, 2, NB, BS, Hkv_local, D]
        for sends, offset, layers, ids in self._pushes:
            if sends.broken or (layers == ALL_LAYERS and layer != 0):
                continue
            try:
                if layers == ALL_LAYERS:
                    sends.sender.send_layers(sends.handles, offset, cache, ids)
                else:
                    sends.sender.send_blocks(sends.handles, layer, offset, cache[layer], ids)
            except (TransferError, ValueError) as e:
                # A broken transfer must never stop the forward; finish() reports it.
                log.warning("KV push of job %d stopped: %s", sends.job_id, e)
                sends.broken = True

    def end_step(self) -> None:
        self._pushes = []

    def handle(self, message: object) -> object | None:
        match message:
            case PushStart(job_id, target):
                self._open(job_id, target)
            case PushEnd(job_id, None):
                self._abort(job_id)
            case PushEnd(job_id, timeout_s):
                # Rank 0 does not wait: the decode worker checks that every rank's heads arrived.
                threading.Thread(
                    target=self._finish_quietly, args=(job_id, timeout_s), daemon=True
                ).start()
            case _:
                return super().handle(message)
        return None

    def _finish_quietly(self, job_id: int, timeout_s: float) -> None:
        try:
            self.finish(job_id, timeout_s)
        except TransferError as e:
            log.warning("KV push of job %d failed on this rank: %s", job_id, e)

    def close(self) -> None:
        for job_id in list(self._sends):
            self._abort(job_id)
        for sender in self._senders.values():
            sender.close()
