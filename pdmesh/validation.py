"""Requests made valid in one place, as TGI's `validation.rs` does.

Each edge parses its own wire format into a `RequestSpec` (the gRPC servicer from a
`GenerateRequest`, the HTTP gateway from an OpenAI body); `Validator.validate` checks it, runs
the tokenizer, and returns a `ValidRequest`, the only thing the router generates from. Every
rule and its message lives here (or, for sampling values, in `SamplingParams`, which the engine
checks too); a broken rule raises `InvalidRequest(message, field)`, which the edges answer with
INVALID_ARGUMENT / 400 naming the field. Torch-free.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import SamplingParams

MAX_REQUEST_ID_LEN = 256
# Stop rules are checked at every token of a request, on the engine thread: bounded so that no
# request can make every step of its batch slow.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
INPUT_KINDS = "text, token_ids or chat"


def check_text(value: str, name: str) -> str:
    """`value` when it is text that can be encoded (UTF-8). JSON's `\\ud800` escapes (a lone
    surrogate, not a character) decode to a Python str that cannot: the tokenizer, protobuf and
    the workers would all fail on it, so it is refused here, naming the field."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{name} is not valid Unicode text: {value[e.start : e.end]!r} at character "
            f"{e.start} is a lone surrogate (a \\uD800-\\uDFFF escape that is not half of a pair).",
            name,
        ) from None
    return value


def check_prompt_ids(
    token_ids: Sequence[int], vocab_size: int, max_model_len: int, name: str = "prompt"
) -> None:
    """The rules every prompt meets, as token ids: not empty, in the vocabulary, and leaving
    room for one new token in `max_model_len`."""
    if not token_ids:
        raise InvalidRequest("prompt must not be empty (it has 0 tokens).", name)
    bad = next((t for t in token_ids if t.__class__ is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt_token_ids must be integers in [0, {vocab_size}): token ids must be in the "
            f"model's vocabulary, got {bad!r}.",
            name,
        )
    if len(token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt has {len(token_ids)} tokens; the model's max length (max_model_len) is "
            f"{max_model_len}, which must leave room for at least one new token.",
            name,
        )


def check_stop_rules(stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    """InvalidRequest when the stop rules are larger than a request may have, or a stop string
    is not text."""
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(
            f"stop must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each.",
            "stop",
        )
    for i, s in enumerate(stop):
        check_text(s, f"stop[{i}]")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries.", "stop_token_ids"
        )


@dataclass(frozen=True)
class Prompt:
    """The prompt as the client gave it: exactly one of text, token ids, chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class MaxTokens:
    """The client's max_tokens and how to complete it.

    value: as given (None: unset). name: its field in the client's API. must_fit: prompt + value
    must fit in max_model_len (else value need only be at most max_model_len, and the request
    ends with "length" where the model's length ends). default: what an unset value becomes, at
    most the room left after the prompt; None: all of that room if must_fit, else
    SamplingParams' default."""

    value: int | None = None
    name: str = "max_tokens"
    default: int | None = None
    must_fit: bool = False


@dataclass(frozen=True)
class RequestSpec:
    """One request as an edge parsed it: field types checked, not yet validated."""

    prompt: Prompt
    prompt_field: str = "prompt"
    model: str = ""
    request_id: str = ""
    max_tokens: MaxTokens = field(default_factory=MaxTokens)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams but max_tokens
    deadline: float | None = None  # unix seconds


@dataclass(frozen=True)
class ValidRequest:
    """A request the router may run: prompt token ids and sampling all within the rules."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float | None = None  # unix seconds


Encode = Callable[[str], Awaitable[list[int]]]
EncodeChat = Callable[[list[dict[str, str]]], Awaitable[list[int]]]


class Validator:
    """The rules of one served model. `encode` / `encode_chat` tokenize (the router runs them
    off its event loop); `id_prefix` starts generated request ids."""

    def __init__(
        self,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        encode: Encode,
        encode_chat: EncodeChat,
    ) -> None:
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._encode = encode
        self._encode_chat = encode_chat

    def check_model(self, name: str) -> None:
        check_text(name, "model")
        if name and name != self.model_name:
            raise InvalidRequest(
                f"model {name!r} is not served here; this mesh serves {self.model_name!r}.",
                "model",
            )

    async def tokenize(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        """The prompt's token ids (its text checked first); InvalidRequest naming `name`."""
        if prompt.messages is not None:
            for i, m in enumerate(prompt.messages):
                for key in ("role", "content"):
                    if isinstance(m.get(key), str):
                        check_text(m[key], f"{name}[{i}].{key}")
            return await self._encode_chat(prompt.messages)
        if prompt.text is not None:
            return await self._encode(check_text(prompt.text, name))
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        raise InvalidRequest(f"input must be one of {INPUT_KINDS} (none was set).", "input")

    async def validate(self, spec: RequestSpec, id_prefix: str = "") -> ValidRequest:
        """Everything but the prompt first (cheap), then the prompt through the tokenizer."""
        self.check_model(spec.model)
        check_text(spec.request_id, "request_id")
        if len(spec.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(
                f"request_id must be at most {MAX_REQUEST_ID_LEN} characters.", "request_id"
            )
        check_stop_rules(spec.sampling.get("stop", ()), spec.sampling.get("stop_token_ids", ()))
        wanted = spec.max_tokens
        params = self._sampling(spec.sampling, wanted)
        if wanted.value is not None and not wanted.must_fit and wanted.value > self.max_model_len:
            raise InvalidRequest(
                f"{wanted.name} must be at most {self.max_model_len} (the model's max length), "
                f"got {wanted.value}.",
                wanted.name,
            )
        prompt = await self.tokenize(spec.prompt, spec.prompt_field)
        check_prompt_ids(prompt, self.vocab_size, self.max_model_len, spec.prompt_field)
        max_tokens = self._max_tokens(wanted, len(prompt))
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        request_id = spec.request_id or f"{id_prefix}{uuid.uuid4().hex}"
        return ValidRequest(request_id, prompt, params, spec.deadline)

    @staticmethod
    def _sampling(sampling: dict[str, Any], wanted: MaxTokens) -> SamplingParams:
        """SamplingParams with the client's max_tokens if given (checked by SamplingParams, the
        one place its rules are written), named as the client's API names it."""
        given = {"max_tokens": wanted.value} if wanted.value is not None else {}
        try:
            return SamplingParams(**sampling, **given)
        except InvalidRequest as e:
            name = wanted.name if e.field == "max_tokens" else e.field
            raise InvalidRequest(str(e).replace("max_tokens", wanted.name), name) from None

    def _max_tokens(self, wanted: MaxTokens, prompt_len: int) -> int | None:
        """The request's max_tokens once its prompt is known (None: as SamplingParams has it)."""
        room = self.max_model_len - prompt_len
        if wanted.value is None:
            if wanted.default is None and not wanted.must_fit:
                return None
            return max(1, min(room if wanted.default is None else wanted.default, room))
        if wanted.must_fit and prompt_len + wanted.value > self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {prompt_len + wanted.value} ({prompt_len} in the prompt, "
                f"{wanted.value} in the completion); lower {wanted.name} or shorten the prompt.",
                wanted.name,
            )
        return None


def deadline_in(remaining_s: float | None) -> float | None:
    """A unix-time deadline `remaining_s` from now (None: none)."""
    return time.time() + remaining_s if remaining_s is not None else None
