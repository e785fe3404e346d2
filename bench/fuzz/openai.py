"""Hostile OpenAI bodies for /v1/completions and /v1/chat/completions, by class: `sampling`
(valid requests with one to three hostile sampling fields), `messages` (chat messages and
content parts of the wrong shape, unknown roles, tool calls whose arguments are hostile JSON
texts), `tools` (hostile tool definitions and tool_choice), `json` (bodies that are not JSON,
not an object, too deep, with long integers, invalid UTF-8, lone surrogates, UTF-16, bare NaN)
and `encoding` (Content-Encoding headers that do not match the body, a gzip bomb, a body over
the size limit)."""

from __future__ import annotations

import gzip
import zlib
from functools import cache

from hypothesis import strategies as st

from pdmesh.bench.fuzz.values import (
    CHAT,
    COMPLETIONS,
    FIELD_VALUES,
    HOSTILE,
    HTTP,
    LONG_INTS,
    MAX_BODY_BYTES,
    ROLES,
    SCHEMA,
    TEXT,
    Case,
    Raw,
    dumps,
    fields,
    http_case,
    merged,
    mostly,
    valid_base,
)


def http_sampling() -> st.SearchStrategy[Case]:
    return st.one_of(
        http_case("sampling", COMPLETIONS, merged(valid_base(False), fields(list(FIELD_VALUES)))),
        http_case("sampling", CHAT, merged(valid_base(True), fields(list(FIELD_VALUES)))),
    )


PART = mostly(
    st.fixed_dictionaries(
        {"type": mostly(st.sampled_from(["text", "text", "image_url", "input_audio"]), HOSTILE)},
        optional={"text": mostly(TEXT, HOSTILE), "image_url": HOSTILE},
    ),
    HOSTILE,
)
ARGUMENTS = st.one_of(
    st.just("{}"),
    TEXT,
    st.sampled_from(['{"a": "\\ud800"}', '{"a": ' + "9" * 5000 + "}", "[" * 5000 + "]" * 5000]),
    HOSTILE,
)
TOOL_CALL = mostly(
    st.fixed_dictionaries(
        {
            "function": st.fixed_dictionaries(
                {"name": mostly(st.just("f"), TEXT)}, optional={"arguments": ARGUMENTS}
            )
        },
        optional={"id": st.one_of(TEXT, HOSTILE), "type": mostly(st.just("function"), HOSTILE)},
    ),
    HOSTILE,
)
MESSAGE = mostly(
    st.fixed_dictionaries(
        {
            "role": mostly(st.sampled_from(ROLES), HOSTILE),
            "content": mostly(st.one_of(TEXT, st.lists(PART, min_size=1, max_size=3)), HOSTILE),
        },
        optional={
            "name": st.one_of(TEXT, HOSTILE),
            "tool_calls": mostly(st.lists(TOOL_CALL, min_size=1, max_size=2), HOSTILE),
            "tool_call_id": st.one_of(TEXT, HOSTILE),
        },
    ),
    HOSTILE,
)


def http_messages() -> st.SearchStrategy[Case]:
    messages = mostly(st.lists(MESSAGE, min_size=1, max_size=5), HOSTILE)
    body = st.builds(lambda m, n: {"messages": m, "max_tokens": n}, messages, st.integers(1, 8))
    return http_case("messages", CHAT, body)


TOOL = mostly(
    st.fixed_dictionaries(
        {
            "type": mostly(st.just("function"), HOSTILE),
            "function": mostly(
                st.fixed_dictionaries(
                    {"name": mostly(st.sampled_from(["f", "g"]), TEXT), "parameters": SCHEMA},
                    optional={"description": TEXT, "strict": HOSTILE},
                ),
                HOSTILE,
            ),
        }
    ),
    HOSTILE,
)
TOOL_CHOICE = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.just({"type": "function", "function": {"name": "f"}}),
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, TEXT),
    HOSTILE,
)


def http_tools() -> st.SearchStrategy[Case]:
    extra = st.fixed_dictionaries(
        {"tools": mostly(st.lists(TOOL, min_size=1, max_size=3), HOSTILE)},
        optional={"tool_choice": TOOL_CHOICE, "parallel_tool_calls": HOSTILE},
    )
    return http_case("tools", CHAT, merged(valid_base(True), extra))


BAD_UTF8 = [b"\xed\xa0\x80", b"\xc0\xaf", b"\xff", b"\xe2\x82", b"\xf4\x90\x80\x80"]


def http_json() -> st.SearchStrategy[Case]:
    valid = valid_base(False).map(dumps)
    raw = st.one_of(
        st.binary(max_size=200),
        st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 5000).map(lambda n: b'{"prompt":' * n + b'"t1"' + b"}" * n),
        st.integers(1, 5000).map(lambda n: b"[" * n),
        valid.flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda i: b[:i])),
        st.sampled_from(BAD_UTF8).map(lambda bad: b'{"prompt": "t1 ' + bad + b'"}'),
        st.sampled_from(BAD_UTF8).map(lambda bad: b'{"prompt": "t1", "' + bad + b'": 1}'),
        valid.map(lambda b: b.decode().encode("utf-16")),
        valid.map(lambda b: b"\xef\xbb\xbf" + b),
        st.sampled_from(
            [
                b"[]",
                b"1",
                b"null",
                b'"t1"',
                b"",
                b'{"prompt": "t1", "temperature": NaN}',
                b'{"prompt": "t1", "top_p": -Infinity}',
                b'{"max_tokens": 1, "max_tokens": 99999999, "prompt": "t1"}',
                b'{"prompt": "\\ud800"}',
            ]
        ),
        st.builds(
            lambda name, literal: dumps({"prompt": "t1", name: Raw(literal)}),
            st.sampled_from(sorted(FIELD_VALUES)),
            st.sampled_from([r.text for r in LONG_INTS]),
        ),
    )
    path = st.sampled_from([COMPLETIONS, CHAT])
    return st.builds(lambda body, p: Case("json", HTTP, body, p), raw, path)


@cache
def _bomb() -> bytes:
    """A gzip body that inflates to 1 MiB past the size limit."""
    return gzip.compress(b" " * (MAX_BODY_BYTES + 2**20))


@cache
def _oversize() -> bytes:
    return b'{"prompt": "' + b"t1 " * (MAX_BODY_BYTES // 3 + 10) + b'"}'


def _encoded(body: bytes, coding: str, how: str) -> Case:
    """`body` sent as `how` says under the Content-Encoding `coding` (a gzip bomb: always
    labelled gzip)."""
    if how == "bomb":
        coding = "gzip"
    data = {
        "gzip": lambda: gzip.compress(body),
        "deflate": lambda: zlib.compress(body),
        "truncated": lambda: gzip.compress(body)[:-6],
        "plain": lambda: body,
        "garbage": lambda: b"\x1f\x8b\x08\x00 not gzip",
        "bomb": _bomb,
        "oversize": _oversize,
    }[how]()
    headers = (("Content-Type", "application/json"), ("Content-Encoding", coding))
    return Case("encoding", HTTP, data, COMPLETIONS, headers)


def http_encoding() -> st.SearchStrategy[Case]:
    codings = ["gzip", "x-gzip", "deflate", "br", "zstd", "compress", "foo", "gzip, gzip", ""]
    hows = ["gzip", "deflate", "truncated", "plain", "garbage", "bomb", "oversize"]
    body = valid_base(False).map(dumps)
    return st.builds(_encoded, body, st.sampled_from(codings), st.sampled_from(hows))
