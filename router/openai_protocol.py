"""OpenAI request bodies -> a `RequestSpec` for `pdmesh.validation`, field types checked.

The rules themselves (ranges, sizes, text, the prompt) are `pdmesh.validation`'s and
`SamplingParams`'; this reads OpenAI's shapes. Every rejection is an `InvalidRequest` naming the
field (OpenAI's `param`). Fields OpenAI defines that pdmesh cannot honour are refused when set
to a non-neutral value rather than silently ignored; unknown fields are ignored, as vLLM does,
so tools that send extras keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.validation import Prompt, RequestSpec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TEXT_PART = "text"
_SAMPLING_NUMBERS = ("temperature", "top_p", "top_k", "seed")

# Fields that change the output in ways pdmesh does not implement: (field, its neutral values).
_UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("logprobs", (None, False)),
    ("top_logprobs", (None, 0)),
    ("echo", (None, False)),
    ("suffix", (None, "")),
    ("best_of", (None, 1)),
    ("logit_bias", (None, {})),
    ("presence_penalty", (None, 0, 0.0)),
    ("frequency_penalty", (None, 0, 0.0)),
    ("repetition_penalty", (None, 1, 1.0)),
    ("tools", (None, [])),
    ("functions", (None, [])),
)


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed /v1/completions or /v1/chat/completions body: the request, and how to answer."""

    chat: bool
    spec: RequestSpec
    stream: bool
    include_usage: bool


# -- field readers ----------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _boolean(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"{name} must be true or false, got {v!r}.", name)
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {v!r:.200}.", "stop")
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise InvalidRequest(
            f"stop_token_ids must be a list of integers, got {v!r:.200}.", "stop_token_ids"
        )
    return tuple(v)


def _check_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise InvalidRequest(f"n must be 1 (one choice per request), got {n!r}.", "n")
    for name, neutral in _UNSUPPORTED:
        v = body.get(name)
        # Typed comparison: logprobs=0 is a request for logprobs, not the neutral False.
        if any(v == x and type(v) is type(x) for x in neutral):
            continue
        raise InvalidRequest(f"{name} is not supported by this server (got {v!r}).", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest(
            f"response_format is not supported by this server (got {fmt!r}).", "response_format"
        )


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from the body, unchecked (SamplingParams checks them);
    a field left out or null is absent, so its default applies."""
    kwargs = {
        k: body[k] for k in ("temperature", "top_p", "top_k", "seed") if body.get(k) is not None
    }
    kwargs["stop"] = _stop(body)
    kwargs["stop_token_ids"] = _stop_token_ids(body)
    kwargs["ignore_eos"] = _boolean(body, "ignore_eos")
    if body.get("skip_special_tokens") is not None:
        kwargs["skip_special_tokens"] = _boolean(body, "skip_special_tokens")
    return kwargs


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true.", "stream_options"
        )
    if not isinstance(opts, dict):
        raise InvalidRequest(f"stream_options must be an object, got {opts!r}.", "stream_options")
    include = opts.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise InvalidRequest(
            f"stream_options.include_usage must be true or false, got {include!r}.",
            "stream_options.include_usage",
        )
    return stream, bool(include)


def _model(body: dict[str, Any]) -> str:
    v = body.get("model")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise InvalidRequest(f"model must be a string, got {v!r}.", "model")
    return v


# -- prompts ----------------------------------------------------------------------------------
def _completion_prompt(body: dict[str, Any]) -> Prompt:
    v = body.get("prompt")
    # A list holding one prompt is a batch of one; larger batches would need several choices.
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) != 1:
            raise InvalidRequest(
                f"prompt must be a single prompt; got a batch of {len(v)} (send one request "
                "per prompt).",
                "prompt",
            )
        v = v[0]
    if isinstance(v, str):
        return Prompt(text=v)
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return Prompt(token_ids=list(v))
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, or a list holding one of those; "
        f"got {type(v).__name__}.",
        "prompt",
    )


def _message_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != TEXT_PART:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(
                    f"messages[{i}].content: only text parts are supported, got {kind!r}.",
                    f"messages[{i}].content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"messages[{i}].content: a text part needs a string 'text'.",
                    f"messages[{i}].content",
                )
            texts.append(text)
        return "".join(texts)
    raise InvalidRequest(
        f"messages[{i}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}.",
        f"messages[{i}].content",
    )


def _messages(body: dict[str, Any]) -> Prompt:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise InvalidRequest("messages must be a non-empty list of messages.", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object.", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a string.", f"messages[{i}].role")
        out.append({"role": role, "content": _message_content(m.get("content"), i)})
    return Prompt(messages=out)


# -- bodies -----------------------------------------------------------------------------------
def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object.")
    _check_unsupported(body)
    return body


def parse_completion(body: Any) -> OpenAIRequest:
    """A /v1/completions body. Raises InvalidRequest."""
    body = _object(body)
    stream, include_usage = _stream(body)
    spec = RequestSpec(
        prompt=_completion_prompt(body),
        model=_model(body),
        max_tokens=body.get("max_tokens"),
        must_fit=True,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
        sampling=_sampling(body),
    )
    return OpenAIRequest(False, spec, stream, include_usage)


def parse_chat(body: Any) -> OpenAIRequest:
    """A /v1/chat/completions body. Raises InvalidRequest."""
    body = _object(body)
    stream, include_usage = _stream(body)
    # max_completion_tokens replaces the deprecated max_tokens; either is accepted.
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    spec = RequestSpec(
        prompt=_messages(body),
        prompt_field="messages",
        model=_model(body),
        max_tokens=body.get(name),
        max_tokens_field=name,
        must_fit=True,
        sampling=_sampling(body),
    )
    return OpenAIRequest(True, spec, stream, include_usage)
