"""Llama 3.1 / 3.2 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>` (kept in the text when special tokens are not skipped), with
several calls separated by `;`. A reply that does not begin with a call is content."""

from __future__ import annotations

from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.router.tool_parsers.json_call import JsonCall
from pdmesh.router.tool_parsers.registry import register_parser

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


@register_parser("llama3_json")
class Llama3JsonParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._held = ""
        self._state = "start"  # "start" | "calls" (between calls) | "text" (content to the end)
        self._call: JsonCall | None = None

    @classmethod
    def matches_template(cls, template: str) -> bool:
        # Llama 3.1's template asks for {"name": function name, "parameters": ...} and names
        # its built-in tools' tag.
        return PYTHON_TAG in template or '"parameters"' in template

    def _consume(self, text: str, final: bool) -> None:
        text, self._held = self._held + text, ""
        while text:
            if self._call is not None:
                rest = self._call.feed(text)
                if rest is None:
                    break
                self._call, self._state, text = None, "calls", rest
            elif self._state == "text":
                self.out.content(text)
                break
            else:
                seps = _SEPARATORS if self._state == "calls" else _SEPARATORS[:-1]
                body = text.lstrip(seps)
                if body.startswith(PYTHON_TAG):
                    body = body[len(PYTHON_TAG) :].lstrip(seps)
                if body.startswith("{"):
                    self._call, text = JsonCall(self.out), body
                elif not final and (not body or PYTHON_TAG.startswith(body)):
                    self._held = text  # whitespace, or the tag's beginning: not known yet
                    break
                else:  # the reply is not (or no longer) calls: content, the tag kept if first
                    self._state = "text"
                    text = body if self.out.calls else text
        if final and self._call is not None:
            self._call.end()
