"""One Subscribe stream per decode worker, fanned out to the requests waiting on it.

Decode workers send one message per engine step holding every token of this router's requests;
the link puts each request's deltas on that request's queue. If the stream breaks, every request
on it gets a `LinkLost` marker and the link reconnects.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from pdmesh.logger import get_logger
from pdmesh.router.registry import Worker
from pdmesh.v1 import worker_pb2

log = get_logger(__name__)

RECONNECT_S = 0.5


class LinkLost:
    """Queued for a request whose decode worker's stream broke."""

    def __init__(self, address: str, detail: str) -> None:
        self.address = address
        self.detail = detail


class DecodeLink:
    def __init__(self, worker: Worker, router_id: str) -> None:
        self.worker = worker
        # A fresh id per connection: a decode worker aborts the requests of a closed stream.
        self._router_id = router_id
        self.subscriber_id = ""
        self.connected = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[worker_pb2.RequestDelta | LinkLost]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def register(self, request_id: str) -> asyncio.Queue[worker_pb2.RequestDelta | LinkLost]:
        queue: asyncio.Queue[worker_pb2.RequestDelta | LinkLost] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            self.subscriber_id = f"{self._router_id}-{uuid.uuid4().hex[:8]}"
            call = self.worker.stub.Subscribe(  # type: ignore[attr-defined]
                worker_pb2.SubscribeRequest(subscriber_id=self.subscriber_id)
            )
            detail = "stream ended"
            try:
                async for update in call:
                    if not self.connected.is_set():
                        self.connected.set()
                    for delta in update.deltas:
                        queue = self._queues.get(delta.request_id)
                        if queue is not None:
                            queue.put_nowait(delta)
            except grpc.aio.AioRpcError as e:
                detail = f"{e.code().name}: {e.details()}"
            except asyncio.CancelledError:
                call.cancel()
                raise
            was_connected = self.connected.is_set()
            self.connected.clear()
            if was_connected:
                log.warning("lost the stream of decode worker %s (%s)", self.worker.address, detail)
            for queue in self._queues.values():
                queue.put_nowait(LinkLost(self.worker.address, detail))
            self._queues.clear()
            await asyncio.sleep(RECONNECT_S)
