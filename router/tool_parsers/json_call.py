"""One tool call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as it streams.

`JsonCall.feed` takes text from the object's first character on and returns the text after the
object once it closed. It scans each character once (strings, escapes, nesting), so a call split
at any character streams the same: the name is sent when its string is whole, then the
arguments' own text as it arrives (an object or array value streams; a string value, some
models' JSON text of the arguments, is sent decoded once whole; a call without arguments gets
`{}`). A control character inside a string of the arguments is sent escaped (`\\u0017`): JSON
forbids it raw, and grammars that enforce JSON schemas let it through.
"""

from __future__ import annotations

import json
from typing import Any

from pdmesh.router.tool_parsers.base import Emitter

ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI's and Hermes' name; Llama 3.1's
_WS = " \t\r\n"


class JsonCall:
    def __init__(self, out: Emitter, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.out = out
        self.keys = argument_keys
        self.text = ""  # the object so far
        self.done = False
        self._pos = 0  # next character of `text` to scan
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "start"  # at depth 1: "key", "colon", "value", "comma"
        self._key: str | None = None
        self._start = 0  # where the current top-level key or value began
        self._scalar = False  # the current value is a number, true, false or null
        self._name: str | None = None
        self._args: list[str] | None = None  # an object or array of arguments, as scanned
        self._args_open = False
        self._args_whole: str | None = None  # arguments given whole (a string value)
        self._started = False
        self._index: int | None = None  # the call's index (None: dropped, past max_calls)
        self._sent = 0  # characters of the arguments sent

    def feed(self, text: str) -> str | None:
        """Scan `text`; the text after the object once it closed, else None."""
        self.text += text
        while self._pos < len(self.text) and not self.done:
            c, in_string = self.text[self._pos], self._in_string
            was_open = self._args_open
            self._char(c, self._pos)
            self._pos += 1
            if self._args is not None and (self._args_open or was_open):
                self._args.append(f"\\u{ord(c):04x}" if in_string and c < " " else c)
        self._flush()
        if not self.done:
            return None
        rest, self.text = self.text[self._pos :], self.text[: self._pos]
        return rest

    def _char(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_ended(i)
            return
        if self._depth == 1 and self._scalar and (c in ",}" or c in _WS):
            self._value_ended(self.text[self._start : i].strip())
        if c in _WS:
            return
        if self._expect == "start":
            if c != "{":  # not a call: the text goes back to the caller from this character
                self.out.malformed = True
                self.done = True
                self._pos -= 1
                return
            self._depth, self._expect = 1, "key"
        elif c == '"':
            self._in_string = True
            if self._depth == 1:
                self._start = i
        elif c in "{[":
            if self._depth == 1:
                self._value_began(i)
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(self.text[self._start : i + 1], closed=True)
            elif self._depth == 0:
                self._closed()
        elif self._depth == 1:
            if c == ":":
                self._expect = "value"
            elif c == ",":
                self._expect = "key"
            elif self._expect == "value":
                self._start, self._scalar = i, True
                self._expect = "comma"

    def _value_began(self, i: int) -> None:
        self._start = i
        self._expect = "comma"
        if self._key in self.keys and self._args is None and self._args_whole is None:
            self._args, self._args_open = [], True

    def _string_ended(self, i: int) -> None:
        raw = self.text[self._start : i + 1]
        if self._expect == "key":
            self._key = _loads(raw)
            self._expect = "colon"
        else:
            self._value_ended(raw)

    def _value_ended(self, raw: str, closed: bool = False) -> None:
        self._scalar = False
        self._expect = "comma"
        if self._key == "name" and self._name is None:
            name = _loads(raw)
            self._name = name if isinstance(name, str) else ""
        elif closed and self._args_open:
            self._args_open = False
        elif self._key in self.keys and self._args is None and self._args_whole is None:
            value = _loads(raw)
            self._args_whole = value if isinstance(value, str) else raw

    def _closed(self) -> None:
        self.done = True
        if self._name is None:  # JSON but not a call: the client sees it as content
            self.out.malformed = True
            self.out.content(self.text[: self._pos + 1])
        if self._args is None and self._args_whole is None:
            self._args_whole = "{}"

    def _flush(self) -> None:
        """Send what is certain: the name once whole, then the arguments so far."""
        if self._name is None:
            return
        if not self._started:
            self._started = True
            self._index = self.out.start_call(self._name)
        if self._index is None:
            return
        if self._args_whole is not None:
            args = self._args_whole
        elif self._args is not None:
            args = "".join(self._args)
        else:
            return
        self.out.arguments(self._index, args[self._sent :])
        self._sent = len(args)

    def end(self) -> None:
        """The output ended: a call still open is cut off."""
        if not self.done:
            self.out.malformed = True


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw, strict=False)  # control characters in strings: see above
    except ValueError:
        return None
