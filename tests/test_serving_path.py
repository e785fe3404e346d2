"""The serving path under load (`pdmesh up --colocated`, the router's relay and its gateway's
SSE): concurrent greedy streams over gRPC, `/v1/completions` and `/v1/chat/completions` carry
the offline engine's tokens and text, and every SSE event is json.dumps's layout of its body
(the bytes OpenAI clients and vLLM's benchmark client have always been sent)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from mesh_support import Mesh, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.bench.serving import exact_request
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 24
STREAMS = 8  # per edge: gRPC, completions, chat
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def mesh(small_model_folder: Path) -> Iterator[Mesh]:
    m = start_mesh(
        "--decode",
        "1",
        "--colocated",
        "--kv-cache-tokens",
        "16384",
        http=True,
        model=small_model_folder,
    )
    try:
        yield m
    finally:
        m.stop()


async def _grpc_stream(stub: Any, prompt: list[int]) -> list[gen_pb.GenerateResponse]:
    return [r async for r in stub.Generate(exact_request(prompt, MAX_TOKENS), timeout=300)]


async def _sse(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[str]:
    """The stream's `data:` payloads, [DONE] last."""
    body = {
        **body,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] for e in events]


async def _all_at_once(
    mesh: Mesh, prompts: list[list[int]], chats: list[list[dict[str, str]]]
) -> tuple[list[list[gen_pb.GenerateResponse]], list[list[str]], list[list[str]]]:
    """Every stream of every edge started together."""
    assert mesh.http is not None
    async with (
        grpc.aio.insecure_channel(mesh.target) as ch,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)
        grpc_streams = [_grpc_stream(stub, p) for p in prompts]
        completions = [_sse(session, f"{mesh.http}/v1/completions", {"prompt": p}) for p in prompts]
        chat = [_sse(session, f"{mesh.http}/v1/chat/completions", {"messages": m}) for m in chats]
        n = len(prompts)
        out = await asyncio.gather(*grpc_streams, *completions, *chat)
        return out[:n], out[n : 2 * n], out[2 * n :]


def _bodies(payloads: list[str], chat: bool) -> list[dict[str, Any]]:
    """The events' bodies (each checked to be json.dumps's layout of itself), [DONE] dropped;
    the stream's fields the same on every event, the usage on its last only."""
    assert payloads[-1] == "[DONE]"
    bodies = []
    for payload in payloads[:-1]:
        body = json.loads(payload)
        assert payload == json.dumps(body, ensure_ascii=False)
        bodies.append(body)
    assert len({b["id"] for b in bodies}) == 1 and len({b["created"] for b in bodies}) == 1
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert {b["object"] for b in bodies} == {kind}
    assert all(b["usage"] is None for b in bodies[:-1]) and not bodies[-1]["choices"]
    assert bodies[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    return bodies[:-1]


def _chat_prompt_ids(mesh: Mesh, messages: list[dict[str, str]]) -> list[int]:
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(**m) for m in messages])
        return list(stub.Tokenize(gen_pb.TokenizeRequest(chat=chat), timeout=30).token_ids)


def test_concurrent_streams_on_every_edge_equal_the_offline_engine(
    mesh: Mesh, small_llm: LLM
) -> None:
    rng = random.Random(32)
    vocab = small_llm.engine.info.vocab_size
    lengths = [rng.choice([3, 17, 40, 90, 150]) for _ in range(STREAMS)]
    prompts = [[rng.randrange(1000, vocab) for _ in range(n)] for n in lengths]
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(STREAMS)]
    grpc_streams, completions, chat = asyncio.run(_all_at_once(mesh, prompts, chats))

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chat_ids = [_chat_prompt_ids(mesh, m) for m in chats]
    want = small_llm.generate([{"prompt_token_ids": p} for p in prompts + chat_ids], params)
    want_ids = [w.outputs[0].token_ids for w in want]
    want_texts = [w.outputs[0].text for w in want]

    offline = zip(want_ids[:STREAMS], want_texts[:STREAMS], prompts, strict=True)
    for stream, (ids, text, prompt) in zip(grpc_streams, offline, strict=True):
        assert [t for r in stream for t in r.token_ids] == ids
        assert "".join(r.text for r in stream) == text
        assert stream[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
        assert stream[-1].usage.prompt_tokens == len(prompt)
        assert stream[-1].usage.completion_tokens == MAX_TOKENS

    for payloads, text in zip(completions, want_texts[:STREAMS], strict=True):
        bodies = _bodies(payloads, chat=False)
        assert "".join(b["choices"][0]["text"] for b in bodies) == text
        reasons = [b["choices"][0]["finish_reason"] for b in bodies]
        assert reasons[-1] == "length" and set(reasons[:-1]) == {None}

    for payloads, text in zip(chat, want_texts[STREAMS:], strict=True):
        bodies = _bodies(payloads, chat=True)
        assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = "".join(b["choices"][0]["delta"].get("content", "") for b in bodies[1:])
        assert content == text
        assert bodies[-1]["choices"][0] == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "length",
        }
