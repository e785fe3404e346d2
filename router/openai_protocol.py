"""OpenAI request bodies -> what the router runs, validated field by field.

Every rejection is a `RequestError` naming the field (`param`), so the gateway can answer with
OpenAI's error body. Fields OpenAI defines that pdmesh cannot honour are refused when set to a
non-neutral value rather than silently ignored; unknown fields are ignored, as vLLM does, so
tools that send extras keep working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.serving.convert import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TEXT_PART = "text"

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


class RequestError(ValueError):
    """A bad request body; `param` is the offending field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PromptSpec:
    """The prompt as the client gave it: text to tokenize, token ids, or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed /v1/completions or /v1/chat/completions body.

    max_tokens is None when the client left it out: the gateway then fills in a default that
    fits the prompt into max_model_len."""

    chat: bool
    model: str
    prompt: PromptSpec
    max_tokens: int | None
    sampling: dict[str, Any]  # SamplingParams keyword arguments other than max_tokens
    stream: bool
    include_usage: bool

    def params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The SamplingParams for a prompt of `prompt_len` tokens. Raises RequestError."""
        room = max_model_len - prompt_len
        if self.max_tokens is None:
            wanted = COMPLETION_DEFAULT_MAX_TOKENS if not self.chat else room
            max_tokens = max(1, min(wanted, room))
        else:
            max_tokens = self.max_tokens
            if prompt_len + max_tokens > max_model_len:
                field = "max_completion_tokens" if self.chat else "max_tokens"
                raise RequestError(
                    f"this model's maximum context length is {max_model_len} tokens; the request "
                    f"asks for {prompt_len + max_tokens} ({prompt_len} in the prompt, "
                    f"{max_tokens} in the completion); lower {field} or shorten the prompt.",
                    field,
                )
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None


# -- field readers ----------------------------------------------------------------------------
def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, lo: float, hi: float = math.inf) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v) or not lo <= v <= hi:
        bound = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}]"
        raise RequestError(f"{name} must be a number {bound}, got {v!r}.", name)
    return float(v)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int = 2**63 - 1) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        bound = f">= {lo}" if hi == 2**63 - 1 else f"in [{lo}, {hi}]"
        raise RequestError(f"{name} must be an integer {bound}, got {v!r}.", name)
    return v


def _boolean(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {v!r}.", name)
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
        or len(stops) > MAX_STOP_STRINGS
    ):
        raise RequestError(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
            f"non-empty strings of at most {MAX_STOP_CHARS} characters, got {v!r:.200}.",
            "stop",
        )
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if (
        not isinstance(v, list)
        or len(v) > MAX_STOP_TOKEN_IDS
        or not all(_is_int(t) and t >= 0 for t in v)
    ):
        raise RequestError(
            f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative "
            f"integers, got {v!r:.200}.",
            "stop_token_ids",
        )
    return tuple(v)


def _check_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n must be 1 (one choice per request), got {n!r}.", "n")
    for name, neutral in _UNSUPPORTED:
        v = body.get(name)
        # Typed comparison: logprobs=0 is a request for logprobs, not the neutral False.
        if any(v == x and type(v) is type(x) for x in neutral):
            continue
        raise RequestError(f"{name} is not supported by this server (got {v!r}).", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(
            f"response_format is not supported by this server (got {fmt!r}).", "response_format"
        )


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from the body (defaults where a field is absent)."""
    kwargs: dict[str, Any] = {}
    temperature = _number(body, "temperature", 0.0)
    if temperature is not None:
        kwargs["temperature"] = temperature
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {top_p!r}.", "top_p")
        kwargs["top_p"] = float(top_p)
    top_k = _integer(body, "top_k", -1)
    if top_k is not None:
        kwargs["top_k"] = top_k
    seed = _integer(body, "seed", 0)
    if seed is not None:
        kwargs["seed"] = seed
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
        raise RequestError("stream_options is only allowed when stream is true.", "stream_options")
    if not isinstance(opts, dict):
        raise RequestError(f"stream_options must be an object, got {opts!r}.", "stream_options")
    include = opts.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise RequestError(
            f"stream_options.include_usage must be true or false, got {include!r}.",
            "stream_options.include_usage",
        )
    return stream, bool(include)


def _model(body: dict[str, Any]) -> str:
    v = body.get("model")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise RequestError(f"model must be a string, got {v!r}.", "model")
    return v


# -- prompts ----------------------------------------------------------------------------------
def _completion_prompt(body: dict[str, Any]) -> PromptSpec:
    v = body.get("prompt")
    # A list holding one prompt is a batch of one; larger batches would need several choices.
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) != 1:
            raise RequestError(
                f"prompt must be a single prompt; got a batch of {len(v)} (send one request "
                "per prompt).",
                "prompt",
            )
        v = v[0]
    if isinstance(v, str):
        return PromptSpec(text=v)
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return PromptSpec(token_ids=list(v))
    raise RequestError(
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
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported, got {kind!r}.",
                    f"messages[{i}].content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(
                    f"messages[{i}].content: a text part needs a string 'text'.",
                    f"messages[{i}].content",
                )
            texts.append(text)
        return "".join(texts)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}.",
        f"messages[{i}].content",
    )


def _messages(body: dict[str, Any]) -> PromptSpec:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise RequestError("messages must be a non-empty list of messages.", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object.", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role must be a string.", f"messages[{i}].role")
        out.append({"role": role, "content": _message_content(m.get("content"), i)})
    return PromptSpec(messages=out)


# -- bodies -----------------------------------------------------------------------------------
def parse_completion(body: Any) -> OpenAIRequest:
    """A /v1/completions body. Raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object.")
    _check_unsupported(body)
    stream, include_usage = _stream(body)
    return OpenAIRequest(
        chat=False,
        model=_model(body),
        prompt=_completion_prompt(body),
        max_tokens=_integer(body, "max_tokens", 1),
        sampling=_sampling(body),
        stream=stream,
        include_usage=include_usage,
    )


def parse_chat(body: Any) -> OpenAIRequest:
    """A /v1/chat/completions body. Raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object.")
    _check_unsupported(body)
    stream, include_usage = _stream(body)
    # max_completion_tokens replaces the deprecated max_tokens; either is accepted.
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    return OpenAIRequest(
        chat=True,
        model=_model(body),
        prompt=_messages(body),
        max_tokens=max_tokens,
        sampling=_sampling(body),
        stream=stream,
        include_usage=include_usage,
    )
