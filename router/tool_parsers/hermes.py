"""Hermes 2 Pro, Qwen2.5 and Qwen3 tool calls: each a JSON object `{"name": ..., "arguments":
{...}}` between `<tool_call>` and `</tool_call>`; several in a row are parallel calls, text
before them is the message's content."""

from __future__ import annotations

from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.router.tool_parsers.json_call import JsonCall
from pdmesh.router.tool_parsers.registry import register_parser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held: the tag may follow)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@register_parser("hermes")
class HermesParser(ToolParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._held = ""  # text that may begin a tag
        self._call: JsonCall | None = None
        self._closing = False  # a call's object is whole: its `</tool_call>` may follow

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return OPEN in template

    def _consume(self, text: str, final: bool) -> None:
        text, self._held = self._held + text, ""
        while text:
            if self._call is not None:
                rest = self._call.feed(text)
                if rest is None:
                    break
                self._call, self._closing, text = None, True, rest
            elif self._closing:
                text = text.lstrip()  # whitespace around calls is not content
                if text.startswith(CLOSE):
                    self._closing, text = False, text[len(CLOSE) :]
                elif CLOSE.startswith(text) and not final:
                    self._held = text
                    break
                else:  # no closing tag (some models leave it out): back to text
                    self._closing = False
            else:
                i = text.find(OPEN)
                if i >= 0:
                    self.out.content(text[:i])
                    self._call, text = JsonCall(self.out), text[i + len(OPEN) :]
                    continue
                keep = 0 if final else partial_suffix(text, OPEN)
                self.out.content(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
        if final and self._call is not None:
            self._call.end()
