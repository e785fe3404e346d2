"""logprobs, top_logprobs, echo, n and best_of on the HTTP gateway, in OpenAI's shapes, streamed
and not, with every prompt prefilled on the prefill worker: the values are the offline engine's
(itself checked against transformers in test_logprobs.py)."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mesh_support import Mesh, start_mesh

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = "The three primary colors are"
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh(small_model_folder: Path) -> Iterator[Mesh]:
    # Every prompt prefilled remotely; n=16 choices of 8,000 tokens do not fit the KV cache.
    m = start_mesh(
        "--prefill", "1", "--decode", "1", "--disagg-min-tokens", "1",
        "--kv-cache-tokens", "16384", http=True, model=small_model_folder,
    )  # fmt: skip
    try:
        yield m
    finally:
        m.stop()


def _post(mesh: Mesh, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"{mesh.http}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if body.get("stream"):
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(raw)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def _offline(llm: LLM, prompt: list[int], **sampling: Any):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**sampling))[0]


def _texts(llm: LLM, ids: list[int]) -> list[str]:
    return [llm.get_tokenizer().decode([t]) for t in ids]


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= TOL)


def test_completion_logprobs_streamed_and_whole(mesh: Mesh, small_llm: LLM) -> None:
    prompt = _ids(small_llm, PROMPT)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    status, whole = _post(mesh, "/v1/completions", body)
    assert status == 200, whole
    out = _offline(small_llm, prompt, max_tokens=8, temperature=0, logprobs=3).outputs[0]
    lp = whole["choices"][0]["logprobs"]
    assert lp["tokens"] == _texts(small_llm, out.token_ids)
    expected = [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert all(map(_close, lp["token_logprobs"], expected))
    for top, position in zip(lp["top_logprobs"], out.logprobs, strict=True):
        # The chosen token and the top 3 (greedy: the chosen is the best, so 3 entries).
        want = {small_llm.get_tokenizer().decode([t]): e.logprob for t, e in position.items()}
        assert top.keys() == want.keys() and len(top) == 3
        assert all(_close(top[k], want[k]) for k in top)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(
        b - a == len(s) for a, b, s in zip(offsets, offsets[1:], lp["tokens"], strict=False)
    )
    assert whole["choices"][0]["text"] == out.text

    status, events = _post(mesh, "/v1/completions", {**body, "stream": True})
    assert status == 200
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    joined = {k: [x for p in parts for x in p[k]] for k in lp}
    assert joined == lp  # the same arrays, offsets running on across chunks


def test_echo_returns_the_prompt_and_its_logprobs(mesh: Mesh, small_llm: LLM) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 1."""
    prompt = _ids(small_llm, PROMPT + " red, green and blue")
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    status, whole = _post(mesh, "/v1/completions", body)
    assert status == 200, whole
    out = _offline(small_llm, prompt, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    choice = whole["choices"][0]
    prompt_text = small_llm.get_tokenizer().decode(prompt)
    assert choice["text"] == prompt_text + out.outputs[0].text
    lp = choice["logprobs"]
    assert lp["tokens"] == _texts(small_llm, prompt + out.outputs[0].token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [p[t].logprob for p, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert all(map(_close, lp["token_logprobs"][1 : len(prompt)], expected))
    assert sum(lp["token_logprobs"][1 : len(prompt)]) < 0
    # Streamed: the prompt comes with the first chunk.
    status, events = _post(mesh, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[0]["choices"][0]["logprobs"]["tokens"][: len(prompt)] == lp["tokens"][:-1]


def test_chat_top_logprobs(mesh: Mesh) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    args: dict[str, Any] = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Name a color."}],
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen is the best
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob)
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = list(client.chat.completions.create(**args, stream=True))
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The same tokens and, within fp32's reach, logprobs: the second request finds its prompt in
    # the prefix cache, so its prefill runs in other shapes and its sums round differently.
    assert [e.token for e in entries] == [e.token for e in content]
    for got, want in zip(entries, content, strict=True):
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
    # logprobs false (the default): none in the answer.
    plain = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("shape", [{"n": 3}, {"n": 2, "best_of": 3}])
def test_n_and_best_of_choices(mesh: Mesh, small_llm: LLM, shape: dict[str, int]) -> None:
    prompt = _ids(small_llm, PROMPT)
    sampling = dict(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, **shape)
    out = _offline(small_llm, prompt, **sampling)
    want = {c.index: c.text for c in out.outputs}
    body = {"prompt": prompt, **sampling}
    status, whole = _post(mesh, "/v1/completions", body)
    assert status == 200, whole
    assert {c["index"]: c["text"] for c in whole["choices"]} == want
    assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * shape["n"]
    assert whole["usage"]["completion_tokens"] == 8 * shape["n"]
    status, events = _post(mesh, "/v1/completions", {**body, "stream": True})
    got: dict[int, str] = {}
    finishes = []
    for e in events:
        (c,) = e["choices"]
        got[c["index"]] = got.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            finishes.append(c["index"])
    assert got == want and sorted(finishes) == list(range(shape["n"]))
    # Chat, through the openai client: each choice its own message.
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    chat = client.chat.completions.create(
        model=whole["model"],
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        temperature=1.0,
        seed=3,
        n=shape["n"],
        extra_body={"best_of": shape.get("best_of"), "ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == list(range(shape["n"]))
    assert all(c.message.content for c in chat.choices)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "n": 16, "max_tokens": 8000}, "n"),
        ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
def test_bad_choices_and_logprobs_name_the_field(
    mesh: Mesh, path: str, body: dict[str, Any], param: str
) -> None:
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    status, answer = _post(mesh, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    status, _ = _post(mesh, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200


def test_tool_parameters_the_workers_cannot_enforce_are_400_naming_tools(mesh: Mesh) -> None:
    """A forced tool choice puts the tool's parameters on the output as a JSON schema, which
    the worker compiles; its refusal (field structured_outputs.json) is the tools' fault."""
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "pattern": "(unclosed"}},
            },
        },
    }
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": "required",
    }
    status, answer = _post(mesh, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "tools", answer
    assert "cannot be enforced" in answer["error"]["message"]
