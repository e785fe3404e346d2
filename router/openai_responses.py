"""Response bodies in OpenAI's exact shapes (completions, chat, their stream chunks, errors)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdmesh.router.tool_parsers.base import ToolCall, ToolCallDelta
from pdmesh.v1.generation_pb2 import Usage

ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a missing or wrong key (code invalid_api_key)
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE_BY_STATUS.get(status, "api_error"),
            "param": param,
            "code": code,
        }
    }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def tool_call_delta_body(delta: ToolCallDelta) -> dict[str, Any]:
    """A streamed call's piece: index, id, type and name first, then argument fragments."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def choice_body(
    head: ResponseHead,
    index: int,
    text: str | None,
    finish_reason: str | None,
    tool_calls: list[ToolCall] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streamed answer (`text`: a chat message's content)."""
    if not head.chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [tool_call_body(c) for c in tool_calls]
    reason = finish_reason
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def full_body(head: ResponseHead, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    """A non-streamed text_completion or chat.completion."""
    return {
        "id": head.id,
        "object": "chat.completion" if head.chat else "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage_body(usage),
    }


# json.dumps with an option set builds a new encoder per call; every event uses this one.
_encode = json.JSONEncoder(ensure_ascii=False).encode


class ChunkWriter:
    """Serialises one stream's SSE events: `data: {json}\\n\\n`, then `data: [DONE]\\n\\n`.

    With include_usage every chunk carries `"usage": null` and a last chunk with empty choices
    carries the totals, as OpenAI sends them. Each event is one choice's (`index`), with its
    tokens' `logprobs` in the endpoint's shape when asked for.

    An event is written once per streamed message, so its JSON is put together from parts:
    the fields every event of the stream repeats are encoded once, and a text event without
    logprobs (nearly all of them) encodes only its text. The bytes are json.dumps's own (its
    separators, the keys in order)."""

    DONE = b"data: [DONE]\n\n"

    def __init__(self, head: ResponseHead, include_usage: bool) -> None:
        self.head = head
        self.include_usage = include_usage
        self._object = "chat.completion.chunk" if head.chat else "text_completion"
        fields = {
            "id": head.id,
            "object": self._object,
            "created": head.created,
            "model": head.model,
        }
        # `data: {"id": ..., "model": ...` (its closing brace dropped), then the choices.
        self._head = f'data: {_encode(fields)[:-1]}, "choices": '
        self._tail = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def _event(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        tail = self._tail
        if usage is not None and self.include_usage:
            tail = f', "usage": {_encode(usage_body(usage))}}}\n\n'
        return (self._head + _encode(choices) + tail).encode()

    def role(self, index: int = 0) -> bytes:
        """A chat choice's first chunk: the assistant role with empty content."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._event([choice])

    def text(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if logprobs is None:  # the choice's JSON, as _event would encode it
            reason = "null" if finish_reason is None else _encode(finish_reason)
            if not self.head.chat:
                body = f'"text": {_encode(text)}'
            else:
                body = f'"delta": {{"content": {_encode(text)}}}' if text else '"delta": {}'
            start = f'[{{"index": {index:d}, {body}, "logprobs": null, "finish_reason": '
            return (self._head + start + reason + "}]" + self._tail).encode()
        if self.head.chat:
            delta = {"content": text} if text else {}
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return self._event([choice])

    def tool_calls(
        self,
        content: str,
        calls: list[ToolCallDelta],
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """A chat chunk with content and pieces of tool calls."""
        delta: dict[str, Any] = {"content": content} if content else {}
        delta["tool_calls"] = [tool_call_delta_body(d) for d in calls]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._event([choice])

    def usage(self, usage: Usage) -> bytes:
        return self._event([], usage)

    @staticmethod
    def error(status: int, message: str) -> bytes:
        """An error after the stream began: the headers (200) are gone, so it is an event."""
        return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"


def models_body(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_model_len)]}


def model_card(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "pdmesh",
        "max_model_len": max_model_len,
    }
