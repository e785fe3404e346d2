"""One Subscribe stream per decode worker, fanned out to the requests waiting on it.

Decode workers send one message per engine step holding every token of this router's requests;
the link puts each request's deltas on that request's queue. If the stream breaks, every request
on it gets a `LinkLost` marker and the link reconnects.

This runs once per token of every request, so it is kept lean: a request's queue is a plain list
with one waiter (`DeltaQueue`), not an asyncio.Queue. An aio read costs one turn of the event
loop; that only keeps up because client streams are paced under load (stream_pacing.py), which
keeps the turns short.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import NamedTuple

import grpc

from pdmesh.logger import get_logger
from pdmesh.router.registry import Worker
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)

RECONNECT_S = 0.5


class LinkLost(NamedTuple):
    """Queued for a request whose decode worker's stream broke."""

    address: str
    detail: str


Item = worker_pb2.RequestDelta | LinkLost


class DeltaQueue:
    """One request's undelivered deltas; its single consumer takes everything pending at once."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take_all(self) -> list[Item]:
        """Everything pending; waits for at least one item."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = self._items
        self._items = []
        return items


class DecodeLink:
    def __init__(self, worker: Worker, router_id: str) -> None:
        self.worker = worker
        # Its own stub: the worker's may become a prefill worker's (router/roles.py), and the
        # stream goes on serving the requests it still has.
        assert worker.channel is not None
        self.stub = worker_pb2_grpc.DecodeWorkerStub(worker.channel)
        # A fresh id per connection: a decode worker aborts the requests of a closed stream.
        self._router_id = router_id
        self.subscriber_id = ""
        self.connected = asyncio.Event()
        self._queues: dict[str, DeltaQueue] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def register(self, request_id: str) -> DeltaQueue:
        queue = DeltaQueue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            self.subscriber_id = f"{self._router_id}-{uuid.uuid4().hex[:8]}"
            call = self.stub.Subscribe(
                worker_pb2.SubscribeRequest(subscriber_id=self.subscriber_id)
            )
            detail = "stream ended"
            try:
                async for update in call:
                    if not self.connected.is_set():
                        self.connected.set()
                    queues = self._queues
                    for delta in update.deltas:
                        queue = queues.get(delta.request_id)
                        if queue is not None:
                            queue.put(delta)
            except grpc.aio.AioRpcError as e:
                detail = f"{e.code().name}: {e.details()}"
            except asyncio.CancelledError:
                call.cancel()
                raise
            was_connected = self.connected.is_set()
            self.connected.clear()
            if was_connected:
                log.warning("lost the stream of decode worker %s (%s)", self.worker.address, detail)
            lost = LinkLost(self.worker.address, detail)
            for queue in self._queues.values():
                queue.put(lost)
            self._queues.clear()
            await asyncio.sleep(RECONNECT_S)
