"""Hostile input at the public edges of a running mesh, generated with hypothesis: 1,000 gRPC
`Generate` calls (random and invalid strings, token ids outside the vocabulary, huge, negative
and NaN numbers, huge max_tokens, odd chat messages, bytes that are no protobuf at all) and
1,000 HTTP bodies (the same, plus arbitrary and deeply nested JSON), eight at a time. Every
reply must be a well-formed answer or a proper error; afterwards every service is healthy and
every KV block is free. Plus the message-size limit of every server. The Unicode cases of every
text field are in test_fuzz_unicode.py; its strings are among the fuzz's inputs too."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from fuzz_support import (
    BAD_UTF8,
    GRPC_TEXT_FIELDS,
    LONE_SURROGATES,
    ODD_TEXT,
    bad_utf8_payload,
    fuzz_mesh,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_support import Mesh
from service_support import wait_until

from pdmesh.serving.grpc_server import MAX_MESSAGE_BYTES
from pdmesh.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.timeout(600)

BATCH = 8
EXAMPLES = 125  # x BATCH requests per edge
FINISHED = (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
# A proper refusal of bad input (or of too much of it); anything else is a bug.
PROPER_GRPC_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
PROPER_HTTP = (200, 400, 404, 405, 413, 429)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same 2,000 requests on every run: CI stays reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_outcomes: Counter[str] = Counter()  # "grpc OK", "grpc INVALID_ARGUMENT", "http 200", ...


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from fuzz_mesh(tmp_path_factory)


# -- strategies -------------------------------------------------------------------------------
INT64 = st.integers(-(2**63), 2**63 - 1)
WORDS = st.lists(st.integers(0, 600).map(lambda i: f"t{i}"), max_size=40).map(" ".join)
TEXT = st.one_of(st.text(max_size=120), WORDS, st.sampled_from(ODD_TEXT))
# JSON strings may hold lone surrogates too (st.text leaves category Cs out unless told).
JSON_TEXT = st.one_of(
    TEXT,
    st.text(st.characters(exclude_categories=()), max_size=40),
    st.sampled_from(LONE_SURROGATES),
)
FLOATS = st.one_of(st.floats(), st.floats(0, 2), st.just(math.nan), st.just(-0.0))


def _sampling() -> st.SearchStrategy[gen_pb.SamplingParams]:
    fields = st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(INT64, st.integers(1, 40)),
            "temperature": FLOATS,
            "top_k": st.one_of(INT64, st.integers(-1, 50)),
            "top_p": FLOATS,
            "seed": INT64,
            "stop": st.lists(TEXT, max_size=20),
            "stop_token_ids": st.lists(st.one_of(INT64, st.integers(0, 600)), max_size=8),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
        },
    )
    return fields.map(lambda kw: gen_pb.SamplingParams(**kw))


def _plausible_request() -> st.SearchStrategy[gen_pb.GenerateRequest]:
    """Requests within the rules (so generation itself is fuzzed: stops, seeds, lengths)."""
    sampling = st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.integers(1, 40),
            "temperature": st.floats(0, 2),
            "top_k": st.integers(-1, 600),
            "top_p": st.floats(0.01, 1),
            "seed": st.integers(0, 2**63 - 1),
            "stop": st.lists(st.integers(0, 600).map(lambda i: f"t{i}"), max_size=3),
            "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
            "ignore_eos": st.booleans(),
        },
    ).map(lambda kw: gen_pb.SamplingParams(**kw))
    prompt = st.one_of(
        st.builds(dict, text=WORDS.filter(bool)),
        st.builds(
            dict,
            token_ids=st.lists(st.integers(0, 511), min_size=1, max_size=60).map(
                lambda ids: gen_pb.TokenIds(ids=ids)
            ),
        ),
    )
    return st.builds(lambda p, s: gen_pb.GenerateRequest(sampling=s, **p), prompt, sampling)


def _generate_request() -> st.SearchStrategy[gen_pb.GenerateRequest]:
    token_ids = st.lists(st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1)), max_size=80)
    role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=8))
    call = st.builds(gen_pb.ToolCall, id=TEXT, name=TEXT, arguments=st.one_of(TEXT, st.just("{}")))
    message = st.builds(
        gen_pb.ChatMessage,
        role=role,
        content=TEXT,
        tool_call_id=st.one_of(st.just(""), TEXT),
        tool_calls=st.lists(call, max_size=2),
    )
    schemas = st.sampled_from(["", '{"type": "object"}', "[1]", "{", '{"type": "nonsense"}'])
    tool = st.builds(gen_pb.Tool, name=st.one_of(TEXT, st.just("f")), parameters=schemas)
    choice = st.one_of(
        st.builds(gen_pb.ToolChoice, mode=st.one_of(st.sampled_from(["auto", "required"]), TEXT)),
        st.builds(gen_pb.ToolChoice, function=st.one_of(TEXT, st.just("f"))),
    )
    chat = st.builds(
        lambda ms, tools, c: gen_pb.ChatMessages(messages=ms, tools=tools, tool_choice=c),
        st.lists(message, max_size=6),
        st.lists(tool, max_size=2),
        st.one_of(st.none(), choice),
    )
    prompt = st.one_of(
        st.builds(dict, text=TEXT),
        st.builds(dict, token_ids=token_ids.map(lambda ids: gen_pb.TokenIds(ids=ids))),
        st.builds(dict, chat=chat),
        st.just({}),
    )
    return st.builds(
        lambda p, s, rid, model: gen_pb.GenerateRequest(
            sampling=s, request_id=rid, model=model, **p
        ),
        prompt,
        _sampling(),
        st.one_of(st.just(""), st.text(max_size=300)),
        st.one_of(st.just(""), st.text(max_size=12)),
    )


def _grpc_item() -> st.SearchStrategy[bytes]:
    hostile = _generate_request().map(lambda r: r.SerializeToString())
    plausible = _plausible_request().map(lambda r: r.SerializeToString())
    bad_utf8 = st.builds(
        bad_utf8_payload, st.sampled_from(GRPC_TEXT_FIELDS), st.sampled_from(BAD_UTF8)
    )
    return st.one_of(hostile, plausible, hostile, plausible, st.binary(max_size=300), bad_utf8)


JSON = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)


def _http_item() -> st.SearchStrategy[tuple[str, bytes]]:
    numbers = st.one_of(INT64, st.floats(), st.text(max_size=5), st.none(), st.integers(0, 40))
    function = st.fixed_dictionaries(
        {}, optional={"name": st.one_of(JSON_TEXT, st.just("f")), "arguments": JSON_TEXT}
    )
    message = st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(
                st.sampled_from(["user", "system", "assistant", "tool"]), JSON_TEXT, JSON
            ),
            "content": st.one_of(
                JSON_TEXT,
                JSON,
                st.lists(st.builds(dict, type=st.just("text"), text=JSON_TEXT), max_size=3),
            ),
            "tool_calls": st.one_of(JSON, st.lists(st.builds(dict, function=function), max_size=2)),
            "tool_call_id": st.one_of(JSON_TEXT, JSON),
        },
    )
    body = st.fixed_dictionaries(
        {},
        optional={
            "prompt": st.one_of(JSON_TEXT, st.lists(st.integers(-5, 2**40), max_size=60), JSON),
            "messages": st.one_of(st.lists(message, max_size=5), JSON),
            "model": st.one_of(st.text(max_size=10), JSON_TEXT, JSON),
            "user": JSON_TEXT,
            "tools": st.one_of(
                JSON,
                st.lists(
                    st.builds(
                        dict,
                        type=st.just("function"),
                        function=st.builds(
                            dict,
                            name=st.one_of(JSON_TEXT, st.just("f")),
                            description=JSON_TEXT,
                            parameters=st.one_of(JSON, st.just({"type": "object"})),
                        ),
                    ),
                    max_size=2,
                ),
            ),
            "tool_choice": st.one_of(
                st.sampled_from(["none", "auto", "required"]),
                JSON,
                st.builds(
                    dict,
                    type=st.just("function"),
                    function=st.builds(dict, name=st.one_of(JSON_TEXT, st.just("f"))),
                ),
            ),
            "parallel_tool_calls": st.one_of(st.booleans(), JSON),
            "response_format": st.builds(
                dict, type=st.just("json_schema"), json_schema=st.builds(dict, name=JSON_TEXT)
            ),
            "max_tokens": numbers,
            "max_completion_tokens": numbers,
            "temperature": numbers,
            "top_p": numbers,
            "top_k": numbers,
            "seed": numbers,
            "n": numbers,
            "stop": st.one_of(JSON_TEXT, st.lists(JSON_TEXT, max_size=20), JSON),
            "stream": st.one_of(st.booleans(), JSON),
            "stream_options": st.one_of(st.builds(dict, include_usage=st.booleans()), JSON),
            "logprobs": JSON,
            "ignore_eos": st.one_of(st.booleans(), JSON),
        },
    )
    short_words = st.lists(st.integers(0, 600).map(lambda i: f"t{i}"), min_size=1, max_size=24)
    plausible = st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                short_words.map(" ".join), st.lists(st.integers(0, 511), min_size=1, max_size=24)
            )
        },
        optional={
            "max_tokens": st.integers(1, 32),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "seed": st.integers(0, 2**63 - 1),
            "stop": st.lists(st.integers(0, 600).map(lambda i: f"t{i}"), max_size=3),
            "stream": st.booleans(),
        },
    ).map(lambda b: {**b, "stream_options": {"include_usage": True}} if b.get("stream") else b)
    raw = st.one_of(
        plausible.map(lambda b: json.dumps(b).encode()),
        plausible.map(lambda b: json.dumps(b).encode()),
        body.map(lambda b: json.dumps(b).encode()),  # NaN and Infinity are written bare
        JSON.map(lambda j: json.dumps(j).encode()),
        st.binary(max_size=200),
        st.integers(1, 50_000).map(lambda n: b"[" * n + b"]" * n),
    )
    path = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    return st.tuples(path, raw)


# -- checks -----------------------------------------------------------------------------------
def _check_grpc(channel: grpc.Channel, payload: bytes) -> None:
    call = channel.unary_stream(
        "/pdmesh.v1.Generation/Generate",
        request_serializer=None,
        response_deserializer=gen_pb.GenerateResponse.FromString,
    )
    try:
        replies = list(call(payload, timeout=60))
    except grpc.RpcError as e:
        assert e.code() in PROPER_GRPC_ERRORS, (e.code(), e.details(), payload[:200])
        assert e.details(), payload[:200]
        _outcomes[f"grpc {e.code().name}"] += 1
        return
    _outcomes["grpc OK"] += 1
    assert replies and replies[-1].finish_reason in FINISHED, payload[:200]
    assert all(r.finish_reason == gen_pb.FINISH_REASON_UNSPECIFIED for r in replies[:-1])
    tokens = sum(len(r.token_ids) for r in replies)
    assert tokens == replies[-1].usage.completion_tokens >= 1


def _check_http(base: str, path: str, body: bytes) -> None:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        status, content_type, data = r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()
    assert status in PROPER_HTTP, (status, data[:300], body[:200])
    _outcomes[f"http {status}"] += 1
    if status != 200:
        error = json.loads(data)["error"]
        assert error["message"] and error["type"], error
        return
    if content_type.startswith("text/event-stream"):
        events = [e[6:] for e in data.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]", data[-300:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk, chunk
        return
    reply = json.loads(data)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply


def test_fuzzed_grpc_requests_get_answers_or_proper_errors(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.target) as channel, ThreadPoolExecutor(BATCH) as pool:

        @SETTINGS
        @given(st.lists(_grpc_item(), min_size=BATCH, max_size=BATCH))
        def run(batch: list[bytes]) -> None:
            list(pool.map(lambda p: _check_grpc(channel, p), batch))

        run()
    print(sorted(_outcomes.items()))
    assert sum(n for k, n in _outcomes.items() if k.startswith("grpc")) >= EXAMPLES * BATCH
    assert _outcomes["grpc OK"] >= EXAMPLES  # the generation path was exercised too


def test_fuzzed_http_bodies_get_answers_or_proper_errors(mesh: Mesh) -> None:
    assert mesh.http is not None
    with ThreadPoolExecutor(BATCH) as pool:

        @SETTINGS
        @given(st.lists(_http_item(), min_size=BATCH, max_size=BATCH))
        def run(batch: list[tuple[str, bytes]]) -> None:
            list(pool.map(lambda item: _check_http(mesh.http or "", *item), batch))

        run()
    print(sorted(_outcomes.items()))
    assert sum(n for k, n in _outcomes.items() if k.startswith("http")) >= EXAMPLES * BATCH
    assert _outcomes["http 200"] >= EXAMPLES // 2


def test_every_server_refuses_messages_over_its_limit(mesh: Mesh) -> None:
    big = b"\n" + b"\xff" * (MAX_MESSAGE_BYTES + 1024)  # over the limit, whatever it says
    methods = {
        mesh.target: "/pdmesh.v1.Generation/Generate",
        mesh.decode[0]: "/pdmesh.v1.DecodeWorker/Submit",
        mesh.prefill[0]: "/pdmesh.v1.PrefillWorker/Prefill",
    }
    for address, method in methods.items():
        with grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
        ) as ch:
            call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(big, timeout=30)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, address


def test_after_the_fuzz_every_service_is_healthy_and_every_block_free(mesh: Mesh) -> None:
    for address in [mesh.target, *mesh.decode, *mesh.prefill]:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
    wait_until(
        lambda: all(mesh.stats(a).kv_blocks_used == 0 for a in mesh.decode + mesh.prefill),
        10,
        "every KV block is free",
    )
    assert mesh.proc.poll() is None  # no service died (pdmesh up would have said so)
    assert not any("exited (code" in line for line in mesh.output), mesh.output[-20:]
