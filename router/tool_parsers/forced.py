"""The outputs of `tool_choice` "required" and a named function, whose shapes structured output
enforces (router/tool_choice.py builds the schemas): not chosen by `--tool-call-parser`, they
follow the request's choice whatever the model's own format."""

from __future__ import annotations

import json

from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.router.tool_parsers.json_call import JsonCall

_WS = " \t\r\n"


class RequiredCalls(ToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`: one or more calls (vLLM's format)."""

    name = "required"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._state = "start"  # "start" | "items" (in the list) | "end"
        self._call: JsonCall | None = None

    def _consume(self, text: str, final: bool) -> None:
        while text:
            if self._call is not None:
                rest = self._call.feed(text)
                if rest is None:
                    break
                self._call, text = None, rest
                continue
            text = text.lstrip(_WS + ("," if self._state == "items" else ""))
            if not text:
                break
            if self._state == "start" and text[0] == "[":
                self._state, text = "items", text[1:]
            elif self._state == "items" and text[0] == "{":
                self._call = JsonCall(self.out)
            elif self._state == "items" and text[0] == "]":
                self._state, text = "end", text[1:]
            else:  # structured output did not hold (or the list ended): not calls
                self.out.malformed = True
                self.out.content(text)
                break
        if final and (self._call is not None or self._state != "end"):
            self.out.malformed = True
            if self._call is not None:
                self._call.end()


class NamedCall(ToolParser):
    """The arguments alone, as a JSON object, of the one function named by `tool_choice`: read
    as the arguments of a call whose name is known, so they stream (and are escaped) as any
    call's do, and the name goes out at once."""

    finishes_as_tool_calls = False

    def __init__(self, function: str) -> None:
        super().__init__(max_calls=1)
        self._call = JsonCall(self.out)
        self._call.feed(f'{{"name": {json.dumps(function)}, "arguments": ')

    def _consume(self, text: str, final: bool) -> None:
        if not self._call.done and text:
            self._call.feed(text)
        if final and not self._call.done:
            self._call.feed("}")
            self._call.end()
