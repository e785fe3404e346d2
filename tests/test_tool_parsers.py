"""Tool-call parsers, whole and streamed split at every character (tags, escapes, emoji and
braces inside strings cut everywhere), malformed calls, the parser a chat template asks for and
`--tool-call-parser`, and the schemas tool_choice "required" and a named function enforce."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import LLAMA_STYLE, PING, QWEN_STYLE, WEATHER

from pdmesh.errors import InvalidRequest
from pdmesh.router.tool_choice import ToolUse
from pdmesh.router.tool_parsers.base import StreamDelta, ToolParser
from pdmesh.router.tool_parsers.forced import NamedCall, RequiredCalls
from pdmesh.router.tool_parsers.registry import get_parser, parser_names, pick_parser
from pdmesh.text.chat_messages import check_tools
from pdmesh.text.tokenizer import Tokenizer

HERMES_OUT = (
    "Let me look that up. 🌦\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "São \\"P\\" {}", "n": [1, {"a": "}]"}]}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>'
)
LLAMA_OUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "rain": true}}; '
    '{"name": "ping", "parameters": {}}'
)
REQUIRED_OUT = (
    '[\n  {"name": "get_weather", "parameters": {"city": "Lyon", "unit": "celsius", '
    '"rain": false}},\n  {"name": "ping", "parameters": {}}\n]'
)
NAMED_OUT = ' {\n  "city": "Rome\\n",\n  "unit": "fahrenheit",\n  "rain": true\n}\n'


def _parsers() -> dict[str, Any]:
    hermes, llama = get_parser("hermes"), get_parser("llama3_json")
    return {
        "hermes": (hermes, HERMES_OUT),
        "llama3_json": (llama, LLAMA_OUT),
        "required": (RequiredCalls, REQUIRED_OUT),
        "named": (lambda: NamedCall("get_weather"), NAMED_OUT),
    }


def reassemble(deltas: list[StreamDelta]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, as an OpenAI client accumulates a stream."""
    calls: dict[int, list[str]] = {}
    for d in (d for delta in deltas for d in delta.calls):
        if d.id is not None:
            assert d.index not in calls and d.id.startswith("call_") and d.name
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(d.content for d in deltas), [(n, a) for n, a in calls.values()]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    return reassemble([parser.feed(p) for p in pieces] + [parser.finish()])


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parser.parse(text)
    return content, [(c.name, c.arguments) for c in calls]


# -- parsers ------------------------------------------------------------------------------------
def test_each_format_parses_to_its_calls() -> None:
    p = _parsers()
    content, calls = whole(p["hermes"][0](), HERMES_OUT)
    assert content == "Let me look that up. 🌦"
    assert calls == [
        ("get_weather", '{"city": "São \\"P\\" {}", "n": [1, {"a": "}]"}]}'),
        ("ping", "{}"),
    ]
    assert json.loads(calls[0][1])["city"] == 'São "P" {}'
    assert whole(p["llama3_json"][0](), LLAMA_OUT) == (
        None,
        [("get_weather", '{"city": "Oslo", "rain": true}'), ("ping", "{}")],
    )
    content, calls = whole(RequiredCalls(), REQUIRED_OUT)
    assert content is None and [n for n, _ in calls] == ["get_weather", "ping"]
    content, calls = whole(NamedCall("get_weather"), NAMED_OUT)
    assert content is None and len(calls) == 1
    assert json.loads(calls[0][1]) == {"city": "Rome\n", "unit": "fahrenheit", "rain": True}


@pytest.mark.parametrize("kind", ["hermes", "llama3_json", "required", "named"])
def test_a_stream_split_anywhere_reassembles_to_the_whole_parse(kind: str) -> None:
    """Every split in two, character by character, and random splits (tags, escapes, emoji and
    braces inside strings cut at every place): the same content and calls as the whole text."""
    make, text = _parsers()[kind]
    content, calls = whole(make(), text)
    expected = (content or "", calls)
    for i in range(len(text) + 1):
        assert stream(make(), [text[:i], text[i:]]) == expected, i
    assert stream(make(), list(text)) == expected
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(make(), pieces) == expected


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.lists(
        st.one_of(
            st.text(max_size=20),
            st.sampled_from(["<tool_", "<tool_call", "</tool_call>", "{", '{"name"', "\n", " "]),
        ),
        max_size=8,
    ).map("".join),
    cut=st.integers(0, 200),
)
def test_text_without_calls_is_content_unchanged(text: str, cut: int) -> None:
    hermes = get_parser("hermes")
    if "<tool_call>" not in text:
        assert whole(hermes(), text) == (text, [])
        assert stream(hermes(), [text[:cut], text[cut:]]) == (text, [])
    if not text.lstrip().startswith(("{", "<|python_tag|>")):
        assert whole(get_parser("llama3_json")(), text) == (text, [])


@pytest.mark.parametrize(
    "kind, text",
    [
        ("hermes", '<tool_call>{"name": "ping", "arguments": {"a": 1}'),  # cut off
        ("hermes", "<tool_call>not json</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>'),
        ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
        ("required", '[{"name": "ping", "parameters": {}}'),
        ("named", '{"city": "Ro'),
    ],
)
def test_a_malformed_call_leaves_the_whole_text_as_content(kind: str, text: str) -> None:
    make = _parsers()[kind][0]
    assert whole(make(), text) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    content, calls = whole(get_parser("hermes")(max_calls=1), HERMES_OUT)
    assert content == "Let me look that up. 🌦" and [n for n, _ in calls] == ["get_weather"]
    content, calls = whole(RequiredCalls(max_calls=1), REQUIRED_OUT)
    assert content is None and [n for n, _ in calls] == ["get_weather"]
    assert stream(RequiredCalls(max_calls=1), list(REQUIRED_OUT)) == ("", calls)


def test_the_parser_is_picked_from_the_chat_template(default_model_folder: Path) -> None:
    smollm2 = Tokenizer.load(default_model_folder).chat_template
    assert pick_parser(None, QWEN_STYLE).name == "hermes"  # type: ignore[union-attr]
    assert pick_parser(None, LLAMA_STYLE).name == "llama3_json"  # type: ignore[union-attr]
    # SmolLM2's template ignores tools: pdmesh writes them in the Hermes format.
    assert pick_parser(None, smollm2).name == "hermes"  # type: ignore[union-attr]
    assert pick_parser(None, "{{ tools }} <function=...>") is None  # a format pdmesh lacks
    assert pick_parser("llama3_json", QWEN_STYLE).name == "llama3_json"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--tool-call-parser"):
        pick_parser("nope", QWEN_STYLE)
    assert parser_names() == ["hermes", "llama3_json"]


def test_up_hands_tool_call_parser_to_its_router() -> None:
    from pdmesh.cli import build_parser
    from pdmesh.mesh import plan_mesh
    from pdmesh.router.config import RouterConfig

    cli = build_parser()
    for flags, expected in ((["--tool-call-parser", "llama3_json"], "llama3_json"), ([], None)):
        router = plan_mesh(cli.parse_args(["up", *flags]))[-1]
        assert cli.parse_args(router.command[3:]).tool_call_parser == expected
    with pytest.raises(ValueError, match="--tool-call-parser"):
        RouterConfig(decode=("127.0.0.1:1",), tool_call_parser="qwen9")


# -- tool_choice ------------------------------------------------------------------------------
def test_required_and_named_schemas_accept_exactly_calls_of_the_tools() -> None:
    tools = check_tools([WEATHER, PING])
    required = ToolUse.make(tools, "required").constraint().json  # type: ignore[union-attr]
    jsonschema.validate(json.loads(REQUIRED_OUT), required)
    for name, arguments in whole(RequiredCalls(), REQUIRED_OUT)[1]:
        tool = WEATHER if name == "get_weather" else PING
        jsonschema.validate(json.loads(arguments), tool["function"].get("parameters", {}))
    bad = [{"name": "get_weather", "parameters": {"city": "Lyon"}}]
    for wrong in ([], bad, [{"name": "launch", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    single = ToolUse.make(tools, "required", parallel=False).constraint().json  # type: ignore[union-attr]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(REQUIRED_OUT), single)
    named = ToolUse.make(tools, None, "get_weather").constraint().json  # type: ignore[union-attr]
    jsonschema.validate(json.loads(NAMED_OUT), named)
    assert ToolUse.make(tools, None, "ping").constraint().json == {  # type: ignore[union-attr]
        "type": "object",
        "properties": {},
    }
    assert ToolUse.make(tools, "auto").constraint() is None
    assert ToolUse.make(tools, "none").parser(get_parser("hermes")) is None
    assert ToolUse.make([], "auto") is None
    for choice, function in (("required", None), (None, "ping")):
        with pytest.raises(InvalidRequest, match="no tools") as err:
            ToolUse.make([], choice, function)
        assert err.value.field == "tool_choice"
    with pytest.raises(InvalidRequest, match="launch") as err:
        ToolUse.make(tools, None, "launch")
    with pytest.raises(InvalidRequest, match="--tool-call-parser"):
        ToolUse.make(tools, "auto").parser(None)
