"""Relaying one attempt's tokens to its client, paced: the router's per-token path.

`relay` yields a `Chunk` for whatever piled up on the attempt's queue since the last one (under
load it first waits out the pacer's interval, so tokens gather rather than go one message per
step; see stream_pacing.py). It ends after the chunk with the finish reason
(`attempt.finished`), or when the decode worker's stream broke (`attempt.lost`). A request that
failed on its worker raises the `pdmesh.errors` class of the worker's status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdmesh.errors import from_status
from pdmesh.router.decode_link import LinkLost
from pdmesh.router.dispatch import Attempt
from pdmesh.router.stream_pacing import StreamPacer
from pdmesh.serving.convert import FINISH_FROM_PB

# A decode worker reports a failed request's status as its gRPC code's number.
_STATUS_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


@dataclass
class Chunk:
    """What a client receives at once: new tokens and text, and on the last the outcome."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Any = None  # pdmesh.v1.Usage on the last chunk
    timings: Any = None  # pdmesh.v1.Timings on the last chunk


async def relay(request_id: str, attempt: Attempt, pacer: StreamPacer) -> AsyncIterator[Chunk]:
    loop = asyncio.get_running_loop()
    sent_at: float | None = None  # when the last message went out
    while True:
        if sent_at is not None:
            wait = sent_at + pacer.interval() - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
        chunk, lost = _merge(request_id, await attempt.queue.take_all())
        if chunk.token_ids or chunk.finish_reason is not None:
            attempt.first_tokens()
            attempt.finished = chunk.finish_reason is not None
            yield chunk
            if attempt.finished:
                return
            sent_at = loop.time()
        if lost is not None:
            attempt.lost = lost
            return


def _merge(request_id: str, items: list[Any]) -> tuple[Chunk, LinkLost | None]:
    """One chunk from a request's pending deltas, and the LinkLost marker if its worker's stream
    broke after them (this runs once per token: kept lean)."""
    token_ids: list[int] = []
    texts: list[str] = []
    chunk = Chunk(request_id, token_ids, "", None)
    lost = None
    for item in items:
        if item.__class__ is LinkLost:
            lost = item
            break
        token_ids += item.token_ids
        texts.append(item.text)
        if item.error_code:
            status = _STATUS_NAMES.get(item.error_code, "UNKNOWN")
            raise from_status(status, item.error_message or status)
        if item.finish_reason:
            chunk.finish_reason = FINISH_FROM_PB[item.finish_reason]
            chunk.usage = item.usage
            chunk.timings = item.timings
            break
    chunk.text = "".join(texts)
    return chunk, lost
