"""Requests made valid in one place, as TGI's `validation.rs` does.

Each edge parses its own wire format into a `RequestSpec` (the gRPC servicer from a
`GenerateRequest`, the HTTP gateway from an OpenAI body); `Validator.validate` checks it, runs
the tokenizer, and returns a `ValidRequest`, the only thing the router generates from. Every
rule and its message lives here (or, for sampling values, in `SamplingParams`, which the engine
checks too); a broken rule raises `InvalidRequest(message, field)`, which the edges answer with
INVALID_ARGUMENT / 400 naming the field. Torch-free.

The tokenizer runs on a thread of its own: a text of megabytes takes seconds to tokenize, which
on the event loop would stall every stream the router relays (the Rust tokenizer releases the
GIL while it works). One thread only: a fast tokenizer used from two threads at once can fail
("Already borrowed").
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.json_input import check_json, check_text, parse_json
from pdmesh.sampling_params import SamplingParams, StructuredOutputsParams
from pdmesh.text.chat_template import chat_token_ids
from pdmesh.text.tokenizer import Tokenizer

MAX_REQUEST_ID_LEN = 256
# Stop rules are checked at every token of a request, on the engine thread: bounded so that no
# request can make every step of its batch slow.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# A structured-output constraint as text (a JSON schema as JSON, a regex, a grammar, the choices
# as a JSON list): the grammar compiler's work grows with it, so it is bounded before any.
MAX_SPEC_CHARS = 65_536
# The chat roles a request may use: OpenAI's (developer is its newer name for system).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def check_json_text(value: Any, name: str) -> int:
    """check_text on every string of a JSON value (keys too), naming its path; the number of
    characters in them."""
    if isinstance(value, str):
        return len(check_text(value, name))
    if isinstance(value, dict):
        return sum(
            check_json_text(k, name) + check_json_text(v, f"{name}.{k}") for k, v in value.items()
        )
    if isinstance(value, list):
        return sum(check_json_text(v, f"{name}[{i}]") for i, v in enumerate(value))
    return 0


def check_roles(messages: Sequence[dict[str, Any]], name: str = "messages") -> None:
    """InvalidRequest naming `name[i].role` for a message whose role is not in CHAT_ROLES (a
    template may accept anything, and render a made-up role as a turn of its own)."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{name}[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}.",
                f"{name}[{i}].role",
            )


def check_structured(so: StructuredOutputsParams, field: str | None = None) -> None:
    """InvalidRequest naming `field` (default `structured_outputs.<kind>`, or where inside it)
    when the constraint holds text that is not valid Unicode, a JSON schema breaks the JSON
    limits (pdmesh.json_input), or its text is longer than MAX_SPEC_CHARS. Whether it can be
    compiled is the workers' to say."""
    kind = so.kind
    field = field or f"structured_outputs.{kind}"
    spec = getattr(so, kind)
    if kind == "json_object":
        return
    if kind == "choice":
        for i, choice in enumerate(spec):
            check_text(choice, f"{field}[{i}]")
        text = json.dumps(list(spec))
    elif isinstance(spec, str):
        text = check_text(spec, field)
        if kind == "json":
            parse_json(spec, field)
    else:
        check_json(spec, field, text=True)
        text = json.dumps(spec)
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(
            f"{field} is {len(text):,} characters long as text; at most {MAX_SPEC_CHARS:,} are "
            "accepted.",
            field,
        )


@dataclass(frozen=True)
class Prompt:
    """The prompt as the client gave it: exactly one of text, token ids, chat messages; with
    messages, the tool definitions the chat template renders (checked by the edge)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tools_field: str = "tools"


@dataclass(frozen=True)
class RequestSpec:
    """One request as an edge parsed it: field types checked, not yet validated.

    max_tokens: as given (None: unset), named `max_tokens_field` in the client's API. With
    `must_fit` (OpenAI's rule), prompt + max_tokens must fit in max_model_len and an unset value
    becomes `default_max_tokens` (None: all the room after the prompt), at most that room.
    Without, max_tokens need only be at most max_model_len (the request ends with "length"
    where the model's length ends) and an unset one is SamplingParams' default."""

    prompt: Prompt
    prompt_field: str = "prompt"
    model: str = ""
    request_id: str = ""
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    must_fit: bool = False
    default_max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams but max_tokens
    deadline: float | None = None  # unix seconds


@dataclass(frozen=True)
class ValidRequest:
    """A request the router may run: prompt token ids and sampling all within the rules."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float | None = None  # unix seconds


class Validator:
    """The rules of one served model, and its tokenizer on a thread of its own (`close` stops
    it). Texts that cannot fit in `max_model_len` tokens whatever they say (more characters than
    that many of the vocabulary's longest tokens) are refused before any tokenizer work."""

    def __init__(
        self, model_name: str, vocab_size: int, max_model_len: int, tokenizer: Tokenizer
    ) -> None:
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        # A token's vocabulary string bounds the characters it stands for (byte-level BPE
        # spells each byte as one character, SentencePiece a space as one).
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) + 1
        self.max_chars = max_model_len * longest
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdmesh-tokenizer")

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def tokenize(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        """The prompt's token ids (its text checked first); InvalidRequest naming `name`."""
        if prompt.messages is not None:
            messages, tools = prompt.messages, prompt.tools
            chars = check_json_text(messages, name) + check_json_text(tools, prompt.tools_field)
            check_roles(messages, name)
            self._check_chars(chars, "the chat", name)
            return await self._run(lambda: chat_token_ids(self.tokenizer, messages, tools, name))
        if prompt.text is not None:
            text = check_text(prompt.text, name)
            self._check_chars(len(text), "the prompt", "prompt")
            return await self._run(lambda: self.tokenizer.encode(text))
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        raise InvalidRequest(
            "input must be one of text, token_ids or chat (none was set).", "input"
        )

    def _check_chars(self, n: int, what: str, field: str) -> None:
        if n > self.max_chars:
            raise InvalidRequest(
                f"{what} has {n:,} characters, more than any prompt that fits in the model's "
                f"max length can have ({self.max_chars:,}).",
                field,
            )

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids the sampling names (stop_token_ids, logit_bias' keys) in the vocabulary."""
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{name} must name token ids in the model's vocabulary, [0, "
                    f"{self.vocab_size}); got {bad}.",
                    name,
                )

    async def _run(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def validate(self, spec: RequestSpec, id_prefix: str = "") -> ValidRequest:
        """Everything but the prompt first (cheap), then the prompt through the tokenizer."""
        check_text(spec.model, "model")
        if spec.model and spec.model != self.model_name:
            raise InvalidRequest(
                f"model {spec.model!r} is not served here; this mesh serves {self.model_name!r}.",
                "model",
            )
        check_text(spec.request_id, "request_id")
        if len(spec.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(
                f"request_id must be at most {MAX_REQUEST_ID_LEN} characters.", "request_id"
            )
        check_stop_rules(spec.sampling.get("stop", ()), spec.sampling.get("stop_token_ids", ()))
        params = self._sampling(spec)
        self._check_vocabulary(params)
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs)
        given, name = spec.max_tokens, spec.max_tokens_field
        if given is not None and not spec.must_fit and given > self.max_model_len:
            raise InvalidRequest(
                f"{name} must be at most {self.max_model_len} (the model's max length), "
                f"got {given}.",
                name,
            )
        prompt = await self.tokenize(spec.prompt, spec.prompt_field)
        check_prompt_ids(prompt, self.vocab_size, self.max_model_len, spec.prompt_field)
        room = self.max_model_len - len(prompt)
        if spec.must_fit and given is None:
            params = replace(params, max_tokens=min(spec.default_max_tokens or room, room))
        elif spec.must_fit and given is not None and given > room:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {len(prompt) + given} ({len(prompt)} in the prompt, "
                f"{given} in the completion); lower {name} or shorten the prompt.",
                name,
            )
        request_id = spec.request_id or f"{id_prefix}{uuid.uuid4().hex}"
        return ValidRequest(request_id, prompt, params, spec.deadline)

    @staticmethod
    def _sampling(spec: RequestSpec) -> SamplingParams:
        """SamplingParams with the client's max_tokens if given (checked by SamplingParams, the
        one place its rules are written), named as the client's API names it."""
        given = {"max_tokens": spec.max_tokens} if spec.max_tokens is not None else {}
        try:
            return SamplingParams(**spec.sampling, **given)
        except InvalidRequest as e:
            name = spec.max_tokens_field
            raise InvalidRequest(
                str(e).replace("max_tokens", name), name if e.field == "max_tokens" else e.field
            ) from None
