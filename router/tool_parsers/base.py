"""The tool-call parser contract: a model's output text -> the message's content and the tool
calls in it, whole or as streamed deltas.

Callers may rely on:
- one parser object per generated choice: it holds the state of that choice's stream;
- `feed(delta)` returns only what the text so far makes certain (content deltas, and call deltas
  in OpenAI's shape: a call's first delta carries its index, id and name, later ones fragments of
  its arguments); nothing is taken back. Text that may begin a call is held until it is known;
  `finish()` returns what was held at the end;
- a call's arguments are the model's own JSON text of them, so the fragments of a call
  concatenate to exactly the arguments `parse` gives for the same text, however it was split;
- `parse(text)` is that stream, whole: its calls are the reassembled deltas. When a call is
  malformed (not JSON, no name, arguments not an object, cut off) it returns no calls and the
  whole text as content, as vLLM does;
- whitespace alone between calls, or around them, is not content; with no call the content is
  the text, unchanged;
- at most `max_calls` calls (parallel_tool_calls=false: 1): further calls are dropped whole.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    """A whole call: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call: `id` and `name` in its first delta only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class StreamDelta(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


class Extracted(NamedTuple):
    content: str | None  # None: calls and no other text
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Emitter:
    """What a parser has made certain since the last `take`: content and call deltas."""

    max_calls: int | None
    calls: int = 0  # calls started, dropped ones included
    malformed: bool = False
    _content: list[str] = field(default_factory=list)
    _deltas: list[ToolCallDelta] = field(default_factory=list)
    _trailing_ws: str = ""  # content's trailing whitespace, held: it may precede a call

    def content(self, text: str) -> None:
        text = self._trailing_ws + text
        end = len(text.rstrip())
        if end:
            self._content.append(text[:end])
        self._trailing_ws = text[end:]

    def start_call(self, name: str) -> int | None:
        """The new call's index, or None when it is past `max_calls` (dropped)."""
        self._trailing_ws = ""
        index = self.calls
        self.calls += 1
        if self.max_calls is not None and index >= self.max_calls:
            return None
        self._add(ToolCallDelta(index, new_call_id(), name))
        return index

    def arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._add(ToolCallDelta(index, arguments=fragment))

    def end(self) -> None:
        if not self.calls:  # with no call, the content is the text as it was
            self._content.append(self._trailing_ws)
        self._trailing_ws = ""

    def take(self) -> StreamDelta:
        out = StreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out

    def _add(self, delta: ToolCallDelta) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == delta.index and delta.id is None:
            self._deltas[-1] = ToolCallDelta(
                last.index, last.id, last.name, last.arguments + delta.arguments
            )
        else:
            self._deltas.append(delta)


class ToolParser(ABC):
    """One model format of tool calls (see the module's docstring for the contract).

    A subclass implements `_consume(text, final)`, which reads the text not yet consumed and tells
    `self.out` what it found; `matches_template` says whether a chat template writes its format.
    """

    name: ClassVar[str] = ""
    # Whether an answer that ended in calls says finish_reason "tool_calls" (OpenAI and vLLM
    # keep "stop" for a function the request named in tool_choice).
    finishes_as_tool_calls: ClassVar[bool] = True

    def __init__(self, max_calls: int | None = None) -> None:
        self.out = Emitter(max_calls)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether `template` (a chat template's source) asks the model for this format."""
        return False

    @abstractmethod
    def _consume(self, text: str, final: bool) -> None:
        """Read `text` (new output); `final`: the output ended, nothing may stay held."""

    def feed(self, delta: str) -> StreamDelta:
        self._consume(delta, final=False)
        return self.out.take()

    def finish(self) -> StreamDelta:
        self._consume("", final=True)
        self.out.end()
        return self.out.take()

    @property
    def called(self) -> bool:
        """Whether calls were returned so far and none was malformed (as `parse` would say)."""
        return self.out.calls > 0 and not self.out.malformed

    def parse(self, text: str) -> Extracted:
        """The whole output's content and calls (a fresh parser per text)."""
        parts = [self.feed(text), self.finish()]
        content = "".join(p.content for p in parts)
        calls: dict[int, list[ToolCallDelta]] = {}
        for delta in (d for p in parts for d in p.calls):
            calls.setdefault(delta.index, []).append(delta)
        whole = [
            ToolCall(pieces[0].id or "", pieces[0].name or "", "".join(p.arguments for p in pieces))
            for pieces in calls.values()
        ]
        if self.out.malformed or not all(map(_well_formed, whole)):
            return Extracted(text, [])
        if not whole:
            return Extracted(content, [])
        return Extracted(content or None, whole)


def _well_formed(call: ToolCall) -> bool:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return False
    return bool(call.name) and isinstance(arguments, dict)
