"""OpenAI request bodies -> a `RequestSpec` for `pdmesh.validation`, field types checked.

The rules themselves (ranges, sizes, text, the prompt) are `pdmesh.validation`'s and
`SamplingParams`'; this reads OpenAI's shapes. Every rejection is an `InvalidRequest` naming the
field (OpenAI's `param`). Fields OpenAI defines that pdmesh cannot honour are refused when set
to a non-neutral value rather than silently ignored; unknown fields are ignored, as vLLM does,
so tools that send extras keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.router.openai_structured import structured_from_body
from pdmesh.router.openai_tools import tool_use_from_body
from pdmesh.router.tool_choice import ToolUse
from pdmesh.sampling_params import MAX_LOGPROBS, is_int
from pdmesh.validation import Prompt, RequestSpec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TEXT_PART = "text"
_MESSAGE_TOOL_FIELDS = ("name", "tool_calls", "tool_call_id")
_SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",  # vLLM's extension, as min_tokens
    "min_tokens",
)

# Fields that change the output in ways pdmesh does not implement: (field, its neutral values).
_UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("suffix", (None, "")),
    ("functions", (None, [])),  # deprecated by OpenAI for tools
)


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed /v1/completions or /v1/chat/completions body: the request, and how to answer."""

    chat: bool
    spec: RequestSpec
    stream: bool
    include_usage: bool
    tools: ToolUse | None = None
    # The alternatives to answer per token (chat: top_logprobs; completions: logprobs); None:
    # no logprobs in the answer.
    top_logprobs: int | None = None
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice's text


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _field(v: Any, name: str, ok: Callable[[Any], bool], expected: str, default: Any) -> Any:
    """`v`, the body's `name` (`default` when left out or null); InvalidRequest naming it unless
    `ok(v)`."""
    if v is None:
        return default
    if not ok(v):
        raise InvalidRequest(f"{name} must be {expected}, got {v!r:.200}.", name)
    return v


def _boolean(body: dict[str, Any], name: str) -> bool:
    return _field(body.get(name), name, _is_bool, "true or false", False)


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in _UNSUPPORTED:
        v = body.get(name)
        # Typed comparison: logprobs=0 is a request for logprobs, not the neutral False.
        if any(v == x and type(v) is type(x) for x in neutral):
            continue
        raise InvalidRequest(f"{name} is not supported by this server (got {v!r}).", name)


def _token_id(key: str) -> int:
    """A logit_bias key: OpenAI sends token ids as JSON object keys, so as strings."""
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 19):
        raise InvalidRequest(
            f"logit_bias keys must be token ids (decimal strings), got {key!r:.50}.",
            "logit_bias",
        )
    return int(key)


def _is_dict(v: object) -> bool:
    return isinstance(v, dict)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from the body, unchecked (SamplingParams checks them);
    a field left out or null is absent, so its default applies."""
    kwargs = {k: body[k] for k in _SAMPLING_NUMBERS if body.get(k) is not None}
    stop = _field(
        body.get("stop"),
        "stop",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(map(_is_str, v))),
        "a string or a list of strings",
        (),
    )
    kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    ids = body.get("stop_token_ids")
    kwargs["stop_token_ids"] = tuple(
        _field(ids, "stop_token_ids", lambda v: isinstance(v, list), "a list of integers", ())
    )
    kwargs["ignore_eos"] = _boolean(body, "ignore_eos")
    structured = structured_from_body(body)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    bias = _field(body.get("logit_bias"), "logit_bias", _is_dict, "an object", None)
    if bias:
        kwargs["logit_bias"] = {_token_id(k): v for k, v in bias.items()}
    if body.get("skip_special_tokens") is not None:
        kwargs["skip_special_tokens"] = _boolean(body, "skip_special_tokens")
    return kwargs


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[int | None, bool]:
    """(alternatives per token in the answer or None, echo); the matching SamplingParams
    fields are set in `_sampling`. Chat asks with `logprobs: true` and `top_logprobs: k`,
    completions with `logprobs: k` (and `echo` for the prompt's)."""
    if not chat:
        k = body.get("logprobs")
        if k is not None and not (is_int(k) and 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequest(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {k!r:.50}.",
                "logprobs",
            )
        return k, _boolean(body, "echo")
    if body.get("echo") not in (None, False):
        raise InvalidRequest("echo is for /v1/completions only.", "echo")
    wanted = _boolean(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return (0 if wanted else None), False
    if not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise InvalidRequest(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {top!r:.50}.",
            "top_logprobs",
        )
    if not wanted:
        raise InvalidRequest("top_logprobs needs logprobs: true.", "top_logprobs")
    return top, False


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true.", "stream_options"
        )
    _field(opts, "stream_options", lambda v: isinstance(v, dict), "an object", None)
    name = "stream_options.include_usage"
    return stream, _field(opts.get("include_usage"), name, _is_bool, "true or false", False)


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
    if isinstance(v, list) and all(map(is_int, v)):
        return Prompt(token_ids=list(v))
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, or a list holding one of those; "
        f"got {type(v).__name__}.",
        "prompt",
    )


def _message_content(content: Any, i: int) -> str:
    field = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{field} must be a string or a list of text parts, got {type(content).__name__}.",
            field,
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != TEXT_PART:
            raise InvalidRequest(f"{field}: only text parts are supported, got {kind!r}.", field)
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{field}: a text part needs a string 'text'.", field)
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict[str, Any], tools: ToolUse | None) -> Prompt:
    """The conversation (its tool fields are checked with the template's input, in
    pdmesh.text.chat_messages) and the tools to render."""
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise InvalidRequest("messages must be a non-empty list of messages.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object.", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a string.", f"messages[{i}].role")
        message = {k: m[k] for k in _MESSAGE_TOOL_FIELDS if m.get(k) is not None}
        # OpenAI: an assistant message's content may be null when it has tool calls.
        content = m.get("content")
        if content is not None or role != "assistant" or not m.get("tool_calls"):
            content = _message_content(content, i)
        out.append({"role": role, "content": content, **message})
    return Prompt(messages=out, tools=tools.tools if tools is not None else None)


def parse(body: Any, chat: bool) -> OpenAIRequest:
    """A /v1/chat/completions (`chat`) or /v1/completions body. Raises InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object.")
    _check_unsupported(body)
    stream, include_usage = _stream(body)
    if not chat and body.get("tools"):
        raise InvalidRequest("tools are for /v1/chat/completions only.", "tools")
    tools = tool_use_from_body(body) if chat else None
    sampling = _sampling(body)
    top_logprobs, echo = _logprobs(body, chat)
    if top_logprobs is not None:
        sampling["logprobs"] = top_logprobs
        if echo:
            sampling["prompt_logprobs"] = top_logprobs
    for name in ("n", "best_of"):  # SamplingParams checks them
        if body.get(name) is not None:
            sampling[name] = body[name]
    if tools is not None:
        tools.constrain(sampling)
    # max_completion_tokens replaces chat's deprecated max_tokens; either is accepted.
    given = chat and body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if given else "max_tokens"
    spec = RequestSpec(
        prompt=_messages(body, tools) if chat else _completion_prompt(body),
        prompt_field="messages" if chat else "prompt",
        model=_field(body.get("model"), "model", _is_str, "a string", ""),
        max_tokens=body.get(name),
        max_tokens_field=name,
        must_fit=True,
        default_max_tokens=None if chat else COMPLETION_DEFAULT_MAX_TOKENS,
        sampling=sampling,
    )
    return OpenAIRequest(chat, spec, stream, include_usage, tools, top_logprobs, echo)
