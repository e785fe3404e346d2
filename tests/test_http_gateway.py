"""The OpenAI-compatible HTTP gateway on a real mesh (`pdmesh up`), through the official `openai`
client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from mesh_support import Mesh, start_mesh

from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = start_mesh("--prefill", "1", "--decode", "1", "--kv-cache-tokens", "16384", http=True)
    try:
        yield m
    finally:
        m.stop()


def _request(
    mesh: Mesh, method: str, path: str, body: bytes | dict[str, Any] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(f"{mesh.http}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _grpc_tokens(mesh: Mesh, text: str, max_tokens: int) -> tuple[list[int], str]:
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = gen_pb.GenerateRequest(
            text=text, sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0)
        )
        ids: list[int] = []
        out = ""
        for r in stub.Generate(req, timeout=120):
            ids.extend(r.token_ids)
            out += r.text
        return ids, out


def test_openai_client_streams_a_chat_answer(mesh: Mesh) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_match_grpc_tokens(mesh: Mesh) -> None:
    from openai import OpenAI

    prompt = "The three primary colors are"
    ids, text = _grpc_tokens(mesh, prompt, 12)
    status, _, raw = _request(
        mesh, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    )
    assert status == 200, raw
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == len(ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + len(ids)

    # The same prompt as token ids, streamed through the openai client.
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        prompt_ids = list(stub.Tokenize(gen_pb.TokenizeRequest(text=prompt)).token_ids)
    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    streamed = client.completions.create(
        model=body["model"], prompt=prompt_ids, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text


def test_models_health_and_metrics(mesh: Mesh) -> None:
    status, _, raw = _request(mesh, "GET", "/v1/models")
    models = json.loads(raw)
    assert status == 200 and models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["object"] == "model"
    status, _, raw = _request(mesh, "GET", "/health")
    assert status == 200 and json.loads(raw)["decode_workers"] == 1
    status, headers, raw = _request(mesh, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in (
        "pdmesh_router_requests_total",
        "pdmesh_router_generated_tokens_total",
        "pdmesh_router_request_latency_seconds_bucket",
        "pdmesh_router_time_to_first_token_seconds_bucket",
    ):
        assert name in text
    status, _, raw = _request(mesh, "GET", "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["message"]
    status, _, raw = _request(mesh, "POST", "/v1/completions", b" " * (9 * 2**20))
    assert status == 413 and "MiB" in json.loads(raw)["error"]["message"]


_LONG = "hello " * 9000


_TOOLS: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "ping"}}],
}


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
        ("/v1/completions", {"prompt": _LONG}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, "model"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        (
            "/v1/completions",
            {"prompt": "hi", "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0},
            "repetition_penalty",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/completions", b"{not json", None),
        ("/v1/chat/completions", {**_TOOLS, "tool_choice": _named("launch")}, "tool_choice"),
        ("/v1/chat/completions", {**_TOOLS, "tool_choice": "always"}, "tool_choice"),
        ("/v1/chat/completions", {**_TOOLS, "tools": {"name": "f"}}, "tools"),
        (
            "/v1/chat/completions",
            {**_TOOLS, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {**_TOOLS, "tools": [], "tool_choice": "required"},
            "tool_choice",
        ),
        ("/v1/chat/completions", {**_TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            "/v1/chat/completions",
            {
                **_TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ("/v1/completions", {"prompt": "hi", "tools": _TOOLS["tools"]}, "tools"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    mesh: Mesh, path: str, body: Any, param: str | None
) -> None:
    status, _, raw = _request(mesh, "POST", path, body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0] in error["message"]
    else:
        assert "JSON" in error["message"]


def test_client_disconnect_aborts_the_request(mesh: Mesh) -> None:
    url = urlsplit(mesh.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")
    assert mesh.stats(mesh.decode[0]).num_running == 1
    conn.sock.close()  # leave mid-stream
    conn.close()
    deadline = time.monotonic() + 10
    while mesh.stats(mesh.decode[0]).num_running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mesh.stats(mesh.decode[0]).num_running == 0

    # The mesh still serves after all of the above.
    status, _, raw = _request(
        mesh, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    )
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def test_penalties_and_logit_bias_through_the_mesh(mesh: Mesh, default_llm) -> None:
    """vLLM's sampling extras over HTTP, the prompt prefilled on the prefill worker (so its
    first token is sampled there under the same rules): the offline engine's tokens."""
    from pdmesh import SamplingParams

    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        text = "Write a list of the planets of the solar system, in order, with a short note. " * 5
        prompt = list(stub.Tokenize(gen_pb.TokenizeRequest(text=text)).token_ids)
    assert len(prompt) > 64  # above --disagg-min-tokens: prefilled remotely
    extras = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    bias = {str(prompt[-1]): -100.0, "13": 5.0}
    before = mesh.stats(mesh.decode[0]).remote_prefills
    status, _, raw = _request(
        mesh,
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logit_bias": bias, **extras},
    )
    assert status == 200, raw
    assert mesh.stats(mesh.decode[0]).remote_prefills == before + 1
    params = SamplingParams(
        max_tokens=16, temperature=0, logit_bias={int(k): v for k, v in bias.items()}, **extras
    )
    offline = default_llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    plain = default_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0)
    )
    assert offline.token_ids != plain[0].outputs[0].token_ids  # the extras changed the output
    assert json.loads(raw)["choices"][0]["text"] == offline.text


def test_openai_parse_returns_valid_objects_through_the_mesh(mesh: Mesh) -> None:
    """`client.chat.completions.parse(response_format=Model)` for three models (nested objects,
    enums, arrays, optional fields, number bounds, booleans): the prompt is prefilled on the
    prefill worker, whose first token already obeys the schema, and the decode worker's
    matcher starts from it."""
    import enum

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Role(enum.StrEnum):
        admin = "admin"
        user = "user"

    class Address(BaseModel):
        city: str = Field(max_length=12)
        zip_code: int = Field(ge=0, le=99999)

    class Person(BaseModel):
        name: str = Field(max_length=12)
        role: Role
        address: Address
        tags: list[str] = Field(max_length=2)
        nickname: str | None = Field(max_length=8)

    class Answer(BaseModel):
        value: int = Field(ge=0, le=100000)
        unit: str = Field(max_length=6)
        certain: bool

    class Step(BaseModel):
        order: int = Field(ge=1, le=9)
        action: str = Field(max_length=16)

    class Recipe(BaseModel):
        title: str = Field(max_length=16)
        steps: list[Step] = Field(min_length=1, max_length=2)
        minutes: float | None = Field(ge=0, le=600)

    system = "You are a helpful assistant that answers in JSON. " * 8  # > 64 tokens: remote
    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    before = mesh.stats(mesh.decode[0]).remote_prefills
    # Five until 2026-11-27 (CI time): an array of enums and an optional nested object went;
    # enums, arrays, nested objects and optional fields are still drawn below.
    cases = (
        (Person, "Describe a user."),
        (Answer, "How tall is Everest?"),
        (Recipe, "How do I boil an egg?"),
    )
    for schema, question in cases:
        completion = client.chat.completions.parse(
            model=model,
            messages=[
                # The schema's name first: no prefix-cache hit brings it under 64 new tokens.
                {"role": "system", "content": f"{schema.__name__}. {system}"},
                {"role": "user", "content": question},
            ],
            response_format=schema,
            temperature=0,
            max_tokens=150,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, schema)
    assert mesh.stats(mesh.decode[0]).remote_prefills == before + len(cases)
    status, _, raw = _request(
        mesh,
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "structured_outputs": {"choice": ["Paris", "Rome"]},
            "temperature": 0,
        },
    )
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] in ("Paris", "Rome")


def test_a_constraint_the_workers_cannot_compile_is_400_naming_it(mesh: Mesh) -> None:
    """Compiled where it is enforced (a worker's engine): the router relays the refusal."""
    body = {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}
    status, _, raw = _request(mesh, "POST", "/v1/completions", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert "structured_outputs.regex" in error["message"]
    assert error["param"] == "structured_outputs.regex"  # the worker's field, relayed
    status, _, raw = _request(mesh, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, raw


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 1000},
                "b": {"type": "integer", "minimum": 0, "maximum": 1000},
            },
            "required": ["a", "b"],
        },
    },
}


def test_tool_calls_through_the_mesh(mesh: Mesh) -> None:
    """With the openai SDK on the default model (its template ignores tools: pdmesh writes them
    into the system prompt, which then needs a remote prefill): tool_choice "required" and a
    named function return calls whose arguments validate against the tool's schema; the stream
    the SDK reassembles is the same call; the mesh holds nothing afterwards."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    before = mesh.stats(mesh.decode[0]).remote_prefills
    cases = (
        ("Weather", "What is the weather in Paris?", "required"),
        ("Sums", "What is 12 plus 30?", {"type": "function", "function": {"name": "add"}}),
    )
    for topic, question, choice in cases:
        # A system message of its own first: no prefix-cache hit brings the prompt (the tools
        # are written after it) under 64 new tokens; the streamed repeat is a hit, local.
        system = {"role": "system", "content": f"{topic}. You answer by calling functions."}
        kwargs: dict[str, Any] = dict(
            model=model,
            messages=[system, {"role": "user", "content": question}],
            tools=[WEATHER, ADD],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=100,
        )
        done = client.chat.completions.create(**kwargs).choices[0]
        reason = "tool_calls" if choice == "required" else "stop"  # named: "stop", as OpenAI
        assert done.finish_reason == reason, done.message
        (call,) = done.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        with client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == reason
        (streamed,) = final.message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == (
            call.function.name,
            call.function.arguments,
        )
    assert call.function.name == "add"
    assert mesh.stats(mesh.decode[0]).remote_prefills == before + len(cases)
    assert mesh.stats(mesh.decode[0]).num_running == 0
