"""Tool calling end to end: tools and tool turns through chat templates (transformers' ids; written
into the prompt for a template that ignores them), offline `LLM.chat(tools=...)`, and a tiny
random model with a Qwen-style template through `pdmesh up` (remote prefill forced) over the
openai SDK and gRPC. The parsers alone: test_tool_parsers.py; the default model through the mesh:
test_http_gateway.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from mesh_support import Mesh, start_mesh
from tool_support import PING, QWEN_STYLE, WEATHER

from pdmesh.errors import InvalidRequest
from pdmesh.text.chat_messages import check_tools
from pdmesh.text.chat_template import chat_token_ids
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

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
        # A function tool_choice names ends "stop", as OpenAI and vLLM answer it.
        reason = "tool_calls" if choice == "required" else "stop"
        assert done.finish_reason == reason, done
        (call,) = done.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), schema)
        with client.chat.completions.stream(parallel_tool_calls=False, **kwargs) as s:
            final = s.get_final_completion().choices[0]
        assert final.finish_reason == reason
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
        # A chat without tools, as old clients send it: no new field set.
        plain = gen_pb.GenerateRequest(chat=request.chat, sampling=gen_pb.SamplingParams())
        del plain.chat.tools[:]
        plain.chat.ClearField("tool_choice")
        last = list(stub.Generate(plain, timeout=60))[-1]
        assert last.finish_reason in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
        assert not last.HasField("content") and not last.tool_calls
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
