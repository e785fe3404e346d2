"""Hostile gRPC `GenerateRequest`s, by class: `sampling` (every SamplingParams field at the
edges of int64 and double), `messages` (chat messages, tools and tool calls whose JSON texts are
hostile, tool_choice), `prompt` (text, token ids outside the vocabulary, no input, odd model
names and request ids) and `json` (bytes that are no protobuf message)."""

from __future__ import annotations

from hypothesis import strategies as st

from pdmesh.bench.fuzz.values import (
    FLOAT_EDGES,
    GRPC,
    PB_JSON_TEXT,
    PB_TEXT,
    ROLES,
    WORDS,
    Case,
    grpc_case,
    mostly,
)
from pdmesh.v1 import generation_pb2 as gen_pb

INT64 = st.one_of(
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1)
)
DOUBLE = st.one_of(st.floats(), st.sampled_from(FLOAT_EDGES))


def _pb_sampling() -> st.SearchStrategy[gen_pb.SamplingParams]:
    kwargs = st.fixed_dictionaries(
        {"max_tokens": st.one_of(st.integers(1, 8), INT64)},
        optional={
            "temperature": DOUBLE,
            "top_k": INT64,
            "top_p": DOUBLE,
            "seed": INT64,
            "presence_penalty": DOUBLE,
            "frequency_penalty": DOUBLE,
            "repetition_penalty": DOUBLE,
            "min_tokens": INT64,
            "logprobs": INT64,
            "prompt_logprobs": INT64,
            "n": INT64,
            "best_of": INT64,
            "stop": st.lists(PB_TEXT, max_size=20),
            "stop_token_ids": st.lists(INT64, max_size=5),
            "logit_bias": st.dictionaries(INT64, DOUBLE, max_size=4),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
        },
    )
    return kwargs.map(lambda kw: gen_pb.SamplingParams(**kw))


def _pb_chat() -> st.SearchStrategy[gen_pb.ChatMessages]:
    call = st.builds(
        gen_pb.ToolCall, id=PB_TEXT, name=mostly(st.just("f"), PB_TEXT), arguments=PB_JSON_TEXT
    )
    plain = st.builds(
        gen_pb.ChatMessage,
        role=mostly(st.sampled_from(["system", "user", "assistant"]), st.sampled_from(ROLES)),
        content=mostly(WORDS, PB_TEXT),
    )
    odd = st.builds(
        gen_pb.ChatMessage,
        role=st.one_of(st.sampled_from(ROLES), PB_TEXT),
        content=PB_TEXT,
        tool_call_id=PB_TEXT,
        tool_calls=st.lists(call, max_size=2),
    )
    message = mostly(plain, odd)
    tool = st.builds(
        gen_pb.Tool,
        name=mostly(st.sampled_from(["f", "g"]), PB_TEXT),
        parameters=PB_JSON_TEXT,
    )
    choice = st.one_of(
        st.builds(
            gen_pb.ToolChoice, mode=st.one_of(st.sampled_from(["auto", "required"]), PB_TEXT)
        ),
        st.builds(gen_pb.ToolChoice, function=st.one_of(st.just("f"), PB_TEXT)),
    )
    return st.builds(
        lambda ms, tools, c: gen_pb.ChatMessages(messages=ms, tools=tools, tool_choice=c),
        st.lists(message, min_size=1, max_size=4),
        st.lists(tool, max_size=2),
        st.one_of(st.none(), choice),
    )


def grpc_requests() -> st.SearchStrategy[Case]:
    small = st.builds(gen_pb.SamplingParams, max_tokens=st.integers(1, 8))
    hostile_sampling = st.builds(
        lambda words, s: gen_pb.GenerateRequest(text=words, sampling=s), WORDS, _pb_sampling()
    )
    hostile_chat = st.builds(
        lambda chat, s: gen_pb.GenerateRequest(chat=chat, sampling=s), _pb_chat(), small
    )
    prompt = st.one_of(
        st.builds(dict, text=PB_TEXT),
        st.builds(
            dict,
            token_ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 600), max_size=80).map(
                lambda ids: gen_pb.TokenIds(ids=ids)
            ),
        ),
        st.just({}),
    )
    hostile_prompt = st.builds(
        lambda p, s, model, rid: gen_pb.GenerateRequest(
            sampling=s, model=model, request_id=rid, **p
        ),
        prompt,
        small,
        mostly(st.just(""), PB_TEXT),
        mostly(st.just(""), PB_TEXT),
    )
    garbage = st.binary(max_size=300).map(lambda b: Case("json", GRPC, b))
    return st.one_of(
        grpc_case("sampling", hostile_sampling),
        grpc_case("messages", hostile_chat),
        grpc_case("prompt", hostile_prompt),
        garbage,
    )
