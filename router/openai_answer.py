"""One request's choices as OpenAI answers them: the chunks the router relays (each under its
choice's `index`, the request's last with its usage) turned into SSE events as they come, or
gathered into one body.

Each choice has its own text, tool-call parser and logprobs; with `echo` (completions) the
prompt, and its logprobs when asked for, come before each choice's text. The prompt's logprobs
arrive once, with choice 0's first chunk (for every choice alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdmesh.router.openai_logprobs import (
    CompletionLogprobs,
    TokenTexts,
    chat_content,
    join_arrays,
)
from pdmesh.router.openai_protocol import OpenAIRequest
from pdmesh.router.openai_responses import ChunkWriter, ResponseHead, choice_body, full_body
from pdmesh.router.tool_parsers.base import StreamDelta, ToolCall, ToolParser
from pdmesh.serving.convert import FINISH_FROM_PB
from pdmesh.v1.generation_pb2 import GenerateResponse as Chunk
from pdmesh.v1.generation_pb2 import PositionLogprobs, Usage


def finish_reason(reason: str | None, parser: ToolParser, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the output ended in calls (a cut-off one stays "length"; a
    function named by tool_choice stays "stop", as OpenAI and vLLM answer it)."""
    return "tool_calls" if called and reason == "stop" and parser.finishes_as_tool_calls else reason


@dataclass
class _Choice:
    index: int
    parser: ToolParser | None
    completion_logprobs: CompletionLogprobs | None
    started: bool = False
    texts: list[str] = field(default_factory=list)
    # Logprobs not yet sent (a tool-call parser may hold text back) or, unstreamed, all of
    # them: chat's content entries, or completions' arrays per chunk.
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    arrays: list[dict[str, list[Any]]] = field(default_factory=list)
    finish_reason: str | None = None


class Answer:
    """The choices of one request, fed its chunks in order (`events` streamed, else `add`)."""

    def __init__(
        self,
        req: OpenAIRequest,
        prompt_ids: Sequence[int],
        echo_text: str,
        texts: TokenTexts,
        parser: Callable[[], ToolParser | None],
    ) -> None:
        self.req = req
        self.prompt_ids = list(prompt_ids)
        self.echo_text = echo_text  # with req.echo: before each choice's text
        self.texts = texts
        self.parser = parser
        self.choices: dict[int, _Choice] = {}
        self.prompt_logprobs: list[PositionLogprobs] = []

    # -- both ways ------------------------------------------------------------------------------
    def _choice(self, chunk: Chunk) -> _Choice:
        if chunk.prompt_logprobs:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
        c = self.choices.get(chunk.index)
        if c is None:
            k = self.req.top_logprobs
            arrays = None if k is None or self.req.chat else CompletionLogprobs(k, self.texts)
            c = self.choices[chunk.index] = _Choice(chunk.index, self.parser(), arrays)
        return c

    def _take_logprobs(self, c: _Choice, chunk: Chunk, echo: bool) -> None:
        """The chunk's logprobs (with the echoed prompt's first) onto the choice's pending."""
        k = self.req.top_logprobs
        if k is None:
            return
        if self.req.chat:
            c.chat_logprobs += chat_content(chunk.logprobs, k, self.texts)
            return
        assert c.completion_logprobs is not None
        if echo:
            c.arrays.append(c.completion_logprobs.prompt(self.prompt_ids, self.prompt_logprobs))
        c.arrays.append(c.completion_logprobs.tokens(chunk.token_ids, chunk.logprobs))

    def _pending_logprobs(self, c: _Choice) -> dict[str, Any] | None:
        """What this choice's next event carries (and no later one)."""
        if self.req.top_logprobs is None:
            return None
        if self.req.chat:
            pending, c.chat_logprobs = c.chat_logprobs, []
            return {"content": pending}
        parts, c.arrays = c.arrays, []
        return join_arrays(parts)

    # -- streamed -------------------------------------------------------------------------------
    def events(self, chunk: Chunk, writer: ChunkWriter) -> list[bytes]:
        """The SSE events for one chunk: a chat choice's role first, the echoed prompt with a
        completion's first text, then text or tool-call pieces, and its finish reason."""
        c = self._choice(chunk)
        out: list[bytes] = []
        echo = not c.started and self.req.echo
        if not c.started and self.req.chat:
            out.append(writer.role(c.index))
        c.started = True
        self._take_logprobs(c, chunk, echo)
        text = (self.echo_text if echo else "") + chunk.text
        if c.parser is None:
            if text or (chunk.token_ids and self.req.top_logprobs is not None):
                out.append(writer.text(text, None, c.index, self._pending_logprobs(c)))
        elif text:
            out += self._calls(c, c.parser.feed(text), writer)
        if chunk.finish_reason:
            reason = FINISH_FROM_PB[chunk.finish_reason]
            if c.parser is not None:
                out += self._calls(c, c.parser.finish(), writer)
                reason = finish_reason(reason, c.parser, c.parser.called)
            # OpenAI ends a choice with a chunk of its own carrying only the finish reason.
            out.append(writer.text("", reason, c.index, self._leftover(c)))
        return out

    def _calls(self, c: _Choice, d: StreamDelta, writer: ChunkWriter) -> list[bytes]:
        if d.calls:
            return [writer.tool_calls(d.content, d.calls, c.index, self._pending_logprobs(c))]
        if d.content:
            return [writer.text(d.content, None, c.index, self._pending_logprobs(c))]
        return []

    def _leftover(self, c: _Choice) -> dict[str, Any] | None:
        """Logprobs of tokens whose text a parser held back, on the choice's last event."""
        if self.req.top_logprobs is None or not (c.chat_logprobs or c.arrays):
            return None
        return self._pending_logprobs(c)

    # -- whole ----------------------------------------------------------------------------------
    def add(self, chunk: Chunk) -> None:
        c = self._choice(chunk)
        echo = not c.started and self.req.echo
        c.started = True
        self._take_logprobs(c, chunk, echo)
        c.texts.append((self.echo_text if echo else "") + chunk.text)
        if chunk.finish_reason:
            c.finish_reason = FINISH_FROM_PB[chunk.finish_reason]

    def body(self, head: ResponseHead, usage: Usage) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text: str | None = "".join(c.texts)
            calls: list[ToolCall] | None = None
            reason = c.finish_reason
            if c.parser is not None:
                text, calls = c.parser.parse(text or "")
                reason = finish_reason(reason, c.parser, bool(calls))
            logprobs = self._pending_logprobs(c)
            choices.append(choice_body(head, index, text, reason, calls, logprobs))
        return full_body(head, choices, usage)
