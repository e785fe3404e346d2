"""A request of several choices (n, best_of) whose decode worker was lost mid-stream.

Its choices ran as one request on that worker (the prompt prefilled once, its blocks shared).
Each choice streamed so far is continued as a request of its own: the prompt plus that choice's
tokens already sent, seeded as the choice was (seed + index), on any decode worker, with the
usual failover; the streams are merged back under their choice indexes, and the request's last
chunk carries usage over every choice and the timings of the stream that ended last.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.validation import ValidRequest

# Runs one single-choice request with the tokens already sent: (request, sent) -> its chunks.
RunChoice = Callable[[ValidRequest, list[int]], AsyncIterator[gen_pb.GenerateResponse]]


def choice_request(inp: ValidRequest, index: int) -> ValidRequest:
    """Choice `index` of `inp` as a request of one choice, drawing as that choice did."""
    params = inp.params
    seed = params.seed + index if params.seed is not None else None
    one = dataclasses.replace(params, n=1, best_of=None, seed=seed)
    return dataclasses.replace(inp, request_id=f"{inp.request_id}.{index}", params=one)


async def resume_choices(
    inp: ValidRequest, sent: dict[int, list[int]], ended: set[int], run: RunChoice
) -> AsyncIterator[gen_pb.GenerateResponse]:
    """Continue every choice of `inp` not in `ended` (its tokens so far in `sent`) and yield
    their chunks as they come, under their own indexes; an error in any ends them all."""
    queue: asyncio.Queue[tuple[int, gen_pb.GenerateResponse | Exception | None]]
    queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for chunk in run(choice_request(inp, index), list(sent[index])):
                await queue.put((index, chunk))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    open_ = [i for i in range(inp.params.n) if i not in ended]
    tasks = [asyncio.create_task(pump(i)) for i in open_]
    finals = 0  # each stream's last chunk carries its usage, then the stream ends
    try:
        while finals < len(open_):
            index, item = await queue.get()
            if item is None:
                if index not in ended:
                    raise RuntimeError(f"choice {index} of {inp.request_id} ended without a finish")
                continue
            if isinstance(item, Exception):
                raise item
            item.index = index
            item.request_id = inp.request_id
            sent[index] += item.token_ids
            if item.HasField("usage"):
                finals += 1
                ended.add(index)
                if finals < len(open_):  # only the request's last chunk has usage and timings
                    item.ClearField("usage")
                    item.ClearField("timings")
                else:
                    item.usage.prompt_tokens = len(inp.prompt)
                    item.usage.completion_tokens = sum(len(t) for t in sent.values())
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
