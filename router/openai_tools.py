"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` body fields -> a `ToolUse`, shapes
checked, each refusal naming the field."""

from __future__ import annotations

from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.router.tool_choice import MODES, ToolUse
from pdmesh.text.chat_messages import check_tools

CHOICE = "tool_choice"


def tool_use_from_body(body: dict[str, Any]) -> ToolUse | None:
    tools = body.get("tools")
    checked = check_tools(tools, "tools") if tools is not None else []
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            f"parallel_tool_calls must be true or false, got {parallel!r:.50}.",
            "parallel_tool_calls",
        )
    mode, function = _choice(body.get(CHOICE))
    return ToolUse.make(checked, mode, function, parallel is not False, CHOICE)


def _choice(v: Any) -> tuple[str | None, str | None]:
    """(mode, function name) of a tool_choice: "none" | "auto" | "required" | {"type":
    "function", "function": {"name": ...}}."""
    if v is None or v in MODES:
        return v, None
    function = v.get("function") if isinstance(v, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest(
            f'{CHOICE} must be "none", "auto", "required" or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {v!r:.100}.',
            CHOICE,
        )
    return None, name
