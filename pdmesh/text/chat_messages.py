"""A conversation and its tool definitions as chat templates expect them (the shapes transformers'
`apply_chat_template` documents and vLLM passes): checked, and normalised.

Messages: `role`; `content` a string (null: empty, but kept null on an assistant message with
tool calls, which templates test for); `name`; an assistant's `tool_calls` (OpenAI's
`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments given as JSON text
or an object and handed to templates as an object, as transformers asks and vLLM does); a tool
message's `tool_call_id`. Tools: OpenAI's `{"type": "function", "function": {"name",
"description", "parameters"}}`. Every refusal is an InvalidRequest naming the field.
"""

from __future__ import annotations

import re
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.json_input import parse_json

Message = dict[str, Any]
MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _fail(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(f"{field} {message}", field)


def _optional_str(m: dict[str, Any], key: str, field: str) -> str | None:
    v = m.get(key)
    if v is not None and not isinstance(v, str):
        raise _fail(f"must be a string, got {type(v).__name__}.", f"{field}.{key}")
    return v


def check_messages(messages: Any, field: str = "messages") -> list[Message]:
    """The conversation, normalised (new dicts: the caller's are not changed)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            f"{field} must be a non-empty list of {{'role': ..., 'content': ...}}.", field
        )
    return [_message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, field: str) -> Message:
    if not isinstance(m, dict):
        raise _fail(f"must be an object, got {type(m).__name__}.", field)
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise _fail("must be a non-empty string.", f"{field}.role")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise _fail(f"must be a string, got {type(content).__name__}.", f"{field}.content")
    out: Message = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        value = _optional_str(m, key, field)
        if value is not None:
            out[key] = value
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise _fail("is only allowed on assistant messages.", f"{field}.tool_calls")
        if not isinstance(calls, list):
            raise _fail("must be a list of tool calls.", f"{field}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{field}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if out["content"] is None and "tool_calls" not in out:
        out["content"] = ""  # templates concatenate content: null is an empty message
    return out


def _tool_call(c: Any, field: str) -> dict[str, Any]:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise _fail("must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}.", field)
    if c.get("type", "function") != "function":
        raise _fail(f"must be 'function', got {c.get('type')!r:.50}.", f"{field}.type")
    function = c["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("must be a non-empty string.", f"{field}.function.name")
    arguments = function.get("arguments", {})
    where = f"{field}.function.arguments"
    if isinstance(arguments, str):
        arguments = parse_json(arguments, where) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise _fail("must be a JSON object (or its text).", where)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = _optional_str(c, "id", field)
    if call_id is not None:
        call["id"] = call_id
    return call


def check_tools(tools: Any, field: str = "tools") -> list[dict[str, Any]]:
    """The tool definitions, normalised to OpenAI's shape with only its keys."""
    if not isinstance(tools, list):
        raise _fail(f"must be a list of tools, got {type(tools).__name__}.", field)
    if len(tools) > MAX_TOOLS:
        raise _fail(f"may hold at most {MAX_TOOLS} tools, got {len(tools)}.", field)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise _fail(
                "must be {'type': 'function', 'function': {'name', 'parameters', ...}}.", where
            )
        if tool.get("type") != "function":
            raise _fail(f"must be 'function', got {tool.get('type')!r:.50}.", f"{where}.type")
        function = _function(tool["function"], f"{where}.function")
        if function["name"] in seen:
            raise _fail(
                f"repeats the name {function['name']!r}: function names must be unique.",
                f"{where}.function.name",
            )
        seen.add(function["name"])
        out.append({"type": "function", "function": function})
    return out


def _function(f: dict[str, Any], field: str) -> dict[str, Any]:
    name = f.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise _fail(
            f"must be 1 to 64 letters, digits, underscores, dots or dashes, got {name!r:.80}.",
            f"{field}.name",
        )
    _optional_str(f, "description", field)
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise _fail("must be a JSON schema object.", f"{field}.parameters")
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise _fail("must be true or false.", f"{field}.strict")
    return {k: f[k] for k in _FUNCTION_KEYS if f.get(k) is not None}


def has_tool_turns(messages: list[Message]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)
