"""The gRPC API's chat input (`ChatMessages`) as the conversation, tools and `ToolUse` the router
works with, and parsed tool calls back onto a choice's last `GenerateResponse`. Refusals name
the field as the proto does (`chat.tools[0].parameters`, `chat.tool_choice.mode`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.json_input import parse_json
from pdmesh.router.tool_choice import MODES, ToolUse
from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.text.chat_messages import check_tools
from pdmesh.v1 import generation_pb2 as gen_pb

FIELD = "chat"


def messages_from_pb(chat: gen_pb.ChatMessages) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [_call_from_pb(c) for c in m.tool_calls]
            message["content"] = m.content or None
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def _call_from_pb(c: gen_pb.ToolCall) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function"}
    if c.id:
        call["id"] = c.id
    call["function"] = {"name": c.name, "arguments": c.arguments}
    return call


def tools_from_pb(chat: gen_pb.ChatMessages) -> list[dict[str, Any]]:
    """The checked tool definitions (empty: none)."""
    tools = []
    for i, t in enumerate(chat.tools):
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        if t.parameters:
            function["parameters"] = parse_json(t.parameters, f"{FIELD}.tools[{i}].parameters")
        tools.append({"type": "function", "function": function})
    return check_tools(tools, f"{FIELD}.tools")


def tool_use_from_pb(chat: gen_pb.ChatMessages, tools: list[dict[str, Any]]) -> ToolUse | None:
    field = f"{FIELD}.tool_choice"
    mode = function = None
    if chat.HasField("tool_choice"):
        kind = chat.tool_choice.WhichOneof("choice")
        if kind == "mode":
            mode = chat.tool_choice.mode
            if mode not in MODES:
                raise InvalidRequest(
                    f'{field}.mode must be "none", "auto" or "required", got {mode!r:.50}.',
                    f"{field}.mode",
                )
        elif kind == "function":
            function = chat.tool_choice.function
    parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
    return ToolUse.make(tools, mode, function, parallel, field)


class CallsAtEnd:
    """Each choice's output parsed for tool calls, set on its last response (the one with a
    finish reason): `tool_calls`, `content`, and FINISH_REASON_TOOL_CALLS when it ended in
    calls."""

    def __init__(self, tools: ToolUse, tool_format: type[ToolParser] | None) -> None:
        self.tools, self.tool_format = tools, tool_format
        tools.parser(tool_format)  # InvalidRequest now, before any work, when it cannot parse
        self._texts: dict[int, list[str]] = defaultdict(list)

    def see(self, chunk: gen_pb.GenerateResponse) -> None:
        texts = self._texts[chunk.index]
        texts.append(chunk.text)
        parser = self.tools.parser(self.tool_format) if chunk.finish_reason else None
        if parser is None:
            return
        content, calls = parser.parse("".join(texts))
        del self._texts[chunk.index]
        chunk.content = content or ""
        for call in calls:
            chunk.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        if calls and chunk.finish_reason == gen_pb.FINISH_REASON_STOP:
            chunk.finish_reason = gen_pb.FINISH_REASON_TOOL_CALLS
