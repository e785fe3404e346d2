"""Tools for a chat template that never reads them (SmolLM2's, Llama 2's, ...).

vLLM hands such a template its `tools` and the template drops them: the model never sees a
function's name, description or parameters, so `tool_choice="auto"` cannot work and "required"
fills in arguments blind. TGI and llama.cpp write the tools into the prompt themselves; so does
pdmesh: a system message lists them in the Hermes format (each call a JSON object between
`<tool_call>` tags, the format of Hermes 2 Pro and Qwen, which the router's `hermes` parser
reads back), an assistant's earlier calls become that text, and tool results come back as a
user turn (every template knows the user role; consecutive results are one turn, so templates
that want roles to alternate accept them).
"""

from __future__ import annotations

import json
from typing import Any

from pdmesh.text.chat_messages import Message

_INTRO = (
    "# Tools\n\n"
    "You can call functions to answer the user. Their definitions, one JSON object per line, "
    "are between <tools> and </tools>:\n<tools>\n"
)
_OUTRO = (
    "\n</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and arguments between "
    "<tool_call> and </tool_call>, one block per call:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
)


def tools_text(tools: list[dict[str, Any]]) -> str:
    return _INTRO + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + _OUTRO


def call_text(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def inline_tools(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """The conversation with the tools and tool turns written as text (new dicts)."""
    out: list[Message] = []
    if tools:
        if messages[0]["role"] == "system":
            first, *messages = messages
            out.append({**first, "content": f"{first['content']}\n\n{tools_text(tools)}"})
        else:
            out.append({"role": "system", "content": tools_text(tools)})
    merging = False  # the last turn holds tool results
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if merging:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result})
            merging = True
            continue
        merging = False
        if "tool_calls" in m:
            parts = [m["content"]] if m["content"] else []
            parts += [call_text(c) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(parts)})
        else:
            out.append(m)
    return out
