"""Tool calling: the parsers (whole, and streamed split at every character), tools and tool turns
through chat templates (transformers' ids; injected for a template that ignores them), the
schemas of tool_choice "required" and named functions, and a tiny random model with a Qwen-style
template through `pdmesh up` (remote prefill forced), over the openai SDK and gRPC."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mesh_support import Mesh, start_mesh

from pdmesh.errors import InvalidRequest
from pdmesh.router.tool_choice import ToolUse
from pdmesh.router.tool_parsers.base import StreamDelta, ToolParser
from pdmesh.router.tool_parsers.forced import NamedCall, RequiredCalls
from pdmesh.router.tool_parsers.registry import get_parser, parser_names, pick_parser
from pdmesh.text.chat_messages import check_tools
from pdmesh.text.chat_template import chat_token_ids
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

# A Hermes / Qwen2.5-style template (written for these tests): tools in the system turn, calls
# as <tool_call> JSON, results as user turns in <tool_response>.
QWEN_STYLE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA_STYLE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{{ tools | tojson }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "rain": {"type": "boolean"},
            },
            "required": ["city", "unit", "rain"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "Check the network"}}

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


# -- chat templates -----------------------------------------------------------------------------
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo? Is the network up?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    {"role": "tool", "tool_call_id": "call_2", "content": "up"},
]


@pytest.fixture(scope="module")
def qwen_style_folder(tmp_path_factory: pytest.TempPathFactory, default_model_folder: Path) -> Path:
    """The default model's tokenizer with QWEN_STYLE as its chat template."""
    folder = tmp_path_factory.mktemp("qwen-style")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_folder / name, folder / name)
    (folder / "chat_template.jinja").write_text(QWEN_STYLE)
    return folder


def _hf_ids(folder: Path, messages: list[dict[str, Any]], tools: list[Any]) -> list[int]:
    from transformers import AutoTokenizer

    # transformers wants arguments as objects (vLLM turns OpenAI's JSON text into them).
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    hf = AutoTokenizer.from_pretrained(folder)
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tools_and_tool_turns_render_as_transformers_renders_them(qwen_style_folder: Path) -> None:
    ours = Tokenizer.load(qwen_style_folder)
    tools = check_tools([WEATHER, PING])
    ids = chat_token_ids(ours, CONVERSATION, tools)
    assert ids == _hf_ids(qwen_style_folder, CONVERSATION, tools)
    text = ours.decode(ids)
    assert '"name": "get_weather"' in text and "<tool_response>\n-3 C, snow" in text
    assert '{"name": "ping", "arguments": {}}' in text


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(
    default_model_folder: Path,
) -> None:
    """SmolLM2's template never reads `tools`: they, the calls and the results become text the
    Hermes parser's format describes; a chat without tools renders as before."""
    ours = Tokenizer.load(default_model_folder)
    tools = check_tools([WEATHER, PING])
    text = ours.decode(chat_token_ids(ours, CONVERSATION, tools))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in text and "<tool_call>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    # The two results are one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response>\n<tool_response>" in text
    )
    plain = [{"role": "user", "content": "Hi"}]
    assert chat_token_ids(ours, plain, None) == _hf_ids(default_model_folder, plain, [])


@pytest.mark.parametrize(
    "messages, tools, field",
    [
        ([{"role": "user", "content": "hi", "tool_calls": []}], None, None),
        (
            [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}],
            None,
            "messages[0].tool_calls",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ],
            None,
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], None, "messages[0].tool_call_id"),
        ([{"role": "user", "content": "hi"}], "f", "tools"),
        ([{"role": "user", "content": "hi"}], [{"type": "function"}], "tools[0]"),
        (
            [{"role": "user", "content": "hi"}],
            [{"type": "function", "function": {"name": "two words"}}],
            "tools[0].function.name",
        ),
        (
            [{"role": "user", "content": "hi"}],
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[0].function.parameters",
        ),
        ([{"role": "user", "content": "hi"}], [PING, PING], "tools[1].function.name"),
    ],
)
def test_malformed_messages_and_tools_name_the_field(
    default_model_folder: Path, messages: list[Any], tools: Any, field: str | None
) -> None:
    ours = Tokenizer.load(default_model_folder)

    def render() -> list[int]:
        return chat_token_ids(ours, messages, check_tools(tools) if tools is not None else None)

    if field is None:
        assert render()
        return
    with pytest.raises(InvalidRequest) as err:
        render()
    assert err.value.field == field and str(err.value).startswith(field)


def test_offline_chat_renders_tools(default_llm: Any) -> None:
    from pdmesh import SamplingParams

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    out = default_llm.chat(messages, SamplingParams(max_tokens=1), tools=[WEATHER])[0]
    tokenizer = default_llm.engine.tokenizer
    assert out.prompt_token_ids == chat_token_ids(tokenizer, messages, check_tools([WEATHER]))
    assert "get_weather" in tokenizer.decode(out.prompt_token_ids)


# -- a tiny random model through the mesh -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mesh(
    tmp_path_factory: pytest.TempPathFactory, qwen_style_folder: Path
) -> Iterator[tuple[Mesh, Path]]:
    """A random Qwen2 of the default model's vocabulary, with the Qwen-style template; every
    prompt prefilled on the prefill worker (--disagg-min-tokens 1)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-tools")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    for f in qwen_style_folder.iterdir():
        shutil.copy(f, folder / f.name)
    mesh = start_mesh(
        *("--model", str(folder), "--kv-cache-tokens", "4096", "--disagg-min-tokens", "1"),
        http=True,
    )
    try:
        yield mesh, folder
    finally:
        mesh.stop()


def _no_whitespace(folder: Path) -> dict[str, float]:
    """logit_bias banning whitespace-only tokens: JSON allows whitespace between any two tokens,
    and a random model's argmax is often one of them, forever."""
    tokenizer = Tokenizer.load(folder)
    ids = [i for i in tokenizer.get_vocab().values() if not tokenizer.decode([i]).strip()]
    return {str(i): -100.0 for i in ids}


def test_tiny_model_calls_through_the_mesh(tiny_mesh: tuple[Mesh, Path]) -> None:
    """Named and "required" calls from a random model, enforced by structured output with the
    prompt prefilled remotely: arguments valid against the tool's schema; the stream the openai
    SDK reassembles equals the whole answer; the gRPC API returns the same call."""
    from openai import OpenAI

    mesh, folder = tiny_mesh
    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    extras = dict(temperature=0, max_tokens=60, logit_bias=_no_whitespace(folder))
    schema = WEATHER["function"]["parameters"]
    before = mesh.stats(mesh.decode[0]).remote_prefills
    calls = []
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kwargs: dict[str, Any] = dict(
            model=model, messages=messages, tools=[WEATHER, PING], tool_choice=choice, **extras
        )
        done = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
        assert done.finish_reason == "tool_calls", done
        (call,) = done.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), schema)
        with client.chat.completions.stream(parallel_tool_calls=False, **kwargs) as s:
            final = s.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        (streamed,) = final.message.tool_calls
        assert (streamed.function.name, streamed.function.arguments) == (
            call.function.name,
            call.function.arguments,
        )
        calls.append(call)
    assert calls[0].function.name == "get_weather"
    assert mesh.stats(mesh.decode[0]).remote_prefills == before + 4

    request = gen_pb.GenerateRequest(
        chat=gen_pb.ChatMessages(
            messages=[gen_pb.ChatMessage(role="user", content="Weather in Oslo?")],
            tools=[
                gen_pb.Tool(
                    name="get_weather",
                    description=WEATHER["function"]["description"],
                    parameters=json.dumps(schema),
                ),
                gen_pb.Tool(name="ping", description=PING["function"]["description"]),
            ],
            tool_choice=gen_pb.ToolChoice(function="get_weather"),
        ),
        sampling=gen_pb.SamplingParams(
            max_tokens=60,
            temperature=0,
            logit_bias={int(k): v for k, v in _no_whitespace(folder).items()},
        ),
    )
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        responses = list(stub.Generate(request, timeout=60))
        # The text streams as generated (a random model's control characters raw); the call's
        # arguments are that JSON, escaped.
        raw = json.loads("".join(r.text for r in responses), strict=False)
        assert raw == json.loads(calls[0].function.arguments)
        last = responses[-1]
        assert last.finish_reason == gen_pb.FINISH_REASON_TOOL_CALLS
        assert [(c.name, c.arguments) for c in last.tool_calls] == [
            ("get_weather", calls[0].function.arguments)
        ]
        assert last.content == "" and not any(r.tool_calls for r in responses[:-1])
        # Tokenize renders the tools as the chat template does (transformers' ids).
        tokenize = gen_pb.TokenizeRequest(chat=request.chat)
        tools = check_tools([WEATHER, PING])
        expected = _hf_ids(folder, [{"role": "user", "content": "Weather in Oslo?"}], tools)
        assert list(stub.Tokenize(tokenize).token_ids) == expected
        # An unknown function: INVALID_ARGUMENT naming the field.
        request.chat.tool_choice.function = "launch"
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.tool_choice" in (err.value.details() or "")
    assert mesh.stats(mesh.decode[0]).num_running == 0


def test_tiny_model_auto_reads_calls_with_the_templates_parser(
    tiny_mesh: tuple[Mesh, Path],
) -> None:
    """tool_choice auto (the default with tools) parses with the parser the Qwen-style template
    asks for (hermes); a random model writes no call, so its whole text is the content, as the
    gRPC API streams it; tool_choice none returns the text unparsed."""
    from openai import OpenAI

    mesh, _ = tiny_mesh
    client = OpenAI(base_url=f"{mesh.http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages: list[Any] = [
        *CONVERSATION,
        {"role": "assistant", "content": "Snow in Oslo."},
        {"role": "user", "content": "Thanks"},
    ]
    answers = []
    for choice in ("auto", "none"):
        done = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER, PING],
            tool_choice=choice,
            temperature=0,
            max_tokens=8,
        ).choices[0]
        assert done.finish_reason == "length" and not done.message.tool_calls
        answers.append(done.message.content)
    assert answers[0] == answers[1] and answers[0]
