"""Pushing a prompt's KV blocks layer by layer, on every rank of a prefill worker.

Rank 0 plans each step: for every prompt in the batch with a transfer, the prompt blocks whose
K/V this step completes. The plan (flat int64: job, first transfer block, n, layers, then n block
ids, repeated) travels with the step to every rank; after each layer, each rank sends its own KV
heads of those blocks to the decode ranks that hold them. Blocks complete before the step (a
prompt prefix this worker had cached) are planned with layers = ALL_LAYERS and go at once, every
layer, right after the first layer (`KVSender.send_layers`: a transport may send several layers
as one message), rather than at the pace of a short forward.

The decode worker names the transport of each transfer (it is chosen per pair); the pusher keeps
one sender per transport it was asked for, made on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdmesh.engine.distributed import host_to_device
from pdmesh.engine.kv_layout import kv_heads
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.kv_transfer import (
    KVSender,
    PageGeometry,
    SenderStats,
    SendHandle,
    TransferError,
    TransferStats,
    check_transport,
    create_sender,
    total_stats,
)
from pdmesh.logger import get_logger

log = get_logger(__name__)
# A plan item's `layers`: ONE_LAYER = blocks this step completes, pushed after each layer;
# ALL_LAYERS = blocks complete before it, every layer pushed at once after the first.
ONE_LAYER, ALL_LAYERS = 1, 0


@dataclass(frozen=True)
class Endpoint:
    address: str
    head_start: int
    num_heads: int


@dataclass
class Job:
    job_id: int
    sender: KVSender
    handles: list[SendHandle]
    broken: bool = False
    stats: list[TransferStats] = field(default_factory=list)


class KVPusher:
    def __init__(self, runner: ModelRunner) -> None:
        spec = runner.kv_spec
        self.heads = kv_heads(runner)
        self.geometry = PageGeometry(
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            num_kv_heads=self.heads.count,
            head_start=self.heads.start,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
        )
        self.cache = runner.kv_cache.data  # [L, 2, NB, BS, Hkv_local, D]
        self.senders: dict[str, KVSender] = {}
        self.jobs: dict[int, Job] = {}
        self._plan: torch.Tensor | None = None  # the plan last parsed, and what it said
        self._pushes: list[tuple[Job, int, int, torch.Tensor]] = []
        runner.add_layer_hook(self.push_layer)

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

    def start(
        self,
        job_id: int,
        transport: str,
        transfer_id: str,
        token: bytes,
        num_blocks: int,
        endpoints: list[Endpoint],
    ) -> None:
        sender = self.sender(transport)
        handles: list[SendHandle] = []
        if self.heads.sends:
            lo, hi = self.heads.start, self.heads.start + self.heads.count
            for e in endpoints:
                if e.head_start < hi and lo < e.head_start + e.num_heads:
                    heads = (e.head_start, e.num_heads)
                    handles.append(sender.start(e.address, transfer_id, token, num_blocks, heads))
        self.jobs[job_id] = Job(job_id, sender, handles)

    def push_layer(self, layer: int, plan: torch.Tensor) -> None:
        for job, offset, layers, ids in self._parse(plan):
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

    def _parse(self, plan: torch.Tensor) -> list[tuple[Job, int, int, torch.Tensor]]:
        """The step's plan as (job, first transfer block, layers, block ids on the cache's
        device), read once per step. The ids are copied without a sync: a blocking copy (or
        indexing with a list) in a layer hook would make the host wait for the GPU at every
        layer."""
        if plan is self._plan:
            return self._pushes
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
            pushes.append((job, offset, layers, host_to_device(ids, self.cache.device)))
        self._plan, self._pushes = plan, pushes
        return pushes

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
