"""Pushing a prompt's KV blocks layer by layer from one rank of a prefill worker.

A step's plan (flat int64: job, first transfer block, n, layers, then n block ids, repeated)
travels with the step to every rank; after each layer, each rank sends its own KV heads of
those blocks to the decode ranks that hold them. Blocks complete before the step (a prompt
prefix this worker had cached) are planned with layers = ALL_LAYERS and go at once, every layer,
right after the first layer (`KVSender.send_layers`: a transport may send several layers as one
message), rather than at the pace of a short forward.

The decode worker names the transport of each transfer (it is chosen per pair); the pusher
keeps one sender per transport it was asked for, made on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdmesh.kv_transfer.base import KVSender, SendHandle, TransferError, TransferStats
from pdmesh.kv_transfer.connector import KVBinding
from pdmesh.kv_transfer.registry import check_transport, create_sender
from pdmesh.kv_transfer.stats import SenderStats, total_stats
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.logger import get_logger

log = get_logger(__name__)
# A plan item's `layers`: ONE_LAYER = blocks this step completes, pushed after each layer;
# ALL_LAYERS = blocks complete before it, every layer pushed at once after the first.
ONE_LAYER, ALL_LAYERS = 1, 0


@dataclass
class _Job:
    job_id: int
    sender: KVSender
    handles: list[SendHandle]
    broken: bool = False
    stats: list[TransferStats] = field(default_factory=list)


class KVPusher:
    """One rank's sends. `start`, `abort` and the layer pushes run on the thread that steps the
    engine; `stats` from any thread."""

    def __init__(self, binding: KVBinding) -> None:
        self.heads = binding.heads
        self.geometry = binding.geometry
        self.cache = binding.cache  # [L, 2, NB, BS, Hkv_local, D]
        self.senders: dict[str, KVSender] = {}
        self.jobs: dict[int, _Job] = {}
        self._pushes: list[tuple[_Job, int, int, torch.Tensor]] = []  # the bound plan, parsed

    def check(self, transport: str) -> None:
        """ValueError unless this worker can push over `transport`."""
        check_transport(transport, self.cache.device)

    def sender(self, transport: str) -> KVSender:
        sender = self.senders.get(transport)
        if sender is None:
            self.check(transport)
            sender = self.senders[transport] = create_sender(transport, self.geometry)
        return sender

    @property
    def stats(self) -> SenderStats:
        return total_stats(SenderStats, self.stats_by_transport().values())

    def stats_by_transport(self) -> dict[str, SenderStats]:
        """Any thread: a sender made meanwhile on the engine thread is counted next time."""
        return {name: s.stats for name, s in list(self.senders.items())}

    def start(self, job_id: int, target: KVTarget) -> None:
        sender = self.sender(target.transport)
        handles: list[SendHandle] = []
        if self.heads.sends:
            for e in target.endpoints:
                if e.overlaps(self.heads.start, self.heads.count):
                    heads = (e.head_start, e.num_heads)
                    handles.append(
                        sender.start(
                            e.address, target.transfer_id, target.token, target.num_blocks, heads
                        )
                    )
        self.jobs[job_id] = _Job(job_id, sender, handles)

    def bind_plan(self, plan: torch.Tensor) -> None:
        """Parse the step's plan once, before its forward: (job, first transfer block, layers,
        block ids on the cache's device). The ids are copied without a sync: a blocking copy in
        a layer hook would make the host wait for the GPU at every layer."""
        items = plan.tolist() if plan.numel() else []
        pushes = []
        i = 0
        while i < len(items):
            job_id, offset, n, layers = items[i : i + 4]
            ids = torch.tensor(items[i + 4 : i + 4 + n], dtype=torch.int64)
            i += 4 + n
            job = self.jobs.get(job_id)
            if job is None or job.broken or not job.handles:
                continue
            if self.cache.is_cuda:
                ids = ids.pin_memory().to(self.cache.device, non_blocking=True)
            pushes.append((job, offset, layers, ids))
        self._pushes = pushes

    def push_layer(self, layer: int) -> None:
        for job, offset, layers, ids in self._pushes:
            if job.broken or (layers == ALL_LAYERS and layer != 0):
                continue
            try:
                if layers == ALL_LAYERS:
                    job.sender.send_layers(job.handles, offset, self.cache, ids)
                else:
                    job.sender.send_blocks(job.handles, layer, offset, self.cache[layer], ids)
            except (TransferError, ValueError) as e:
                # A broken transfer must never stop the forward; finish() reports it.
                log.warning("KV push of job %d stopped: %s", job.job_id, e)
                job.broken = True

    def unbind_plan(self) -> None:
        self._pushes = []

    def done(self, job_id: int) -> bool:
        """Every send of the job is done: `finish` returns at once."""
        job = self.jobs.get(job_id)
        return job is not None and not job.broken and all(job.sender.done(h) for h in job.handles)

    def finish(self, job_id: int, timeout_s: float) -> list[TransferStats]:
        job = self.jobs.pop(job_id)
        return [job.sender.finish(h, timeout_s) for h in job.handles]

    def abort(self, job_id: int) -> None:
        job = self.jobs.pop(job_id, None)
        for h in job.handles if job is not None else ():
            job.sender.abort(h)

    def close(self) -> None:
        for job_id in list(self.jobs):
            self.abort(job_id)
        for sender in self.senders.values():
            sender.close()
