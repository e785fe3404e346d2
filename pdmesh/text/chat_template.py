"""A conversation through the model's chat template, to prompt token ids.

The template is rendered as transformers' `apply_chat_template` renders it (the same sandboxed
Jinja environment, globals and filters; the named special tokens as variables; the tool
definitions as `tools`; a generation prompt added), then tokenized without special tokens, so
the ids are transformers' own. A template that never reads `tools` gets them, and any tool
turns, written into the messages instead (pdmesh.text.tool_prompt says why).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdmesh.errors import InvalidRequest
from pdmesh.text.chat_messages import Message, check_messages, has_tool_turns
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.text.tool_prompt import inline_tools

__all__ = ["Message", "chat_token_ids", "renders_tools"]


def chat_token_ids(
    tokenizer: Tokenizer,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    field: str = "messages",
) -> list[int]:
    """The prompt token ids of one conversation through the model's chat template; `tools` are
    checked already (pdmesh.text.chat_messages.check_tools). InvalidRequest naming `field` (the
    messages) when the conversation is malformed, the model has no template, or the template
    refuses it (a role it forbids, ...)."""
    conversation = check_messages(messages, field)
    template = tokenizer.chat_template
    if template is None:
        raise InvalidRequest(
            "this model's tokenizer has no chat template; send a prompt (text or token ids).",
            field,
        )
    if (tools or has_tool_turns(conversation)) and not renders_tools(template):
        conversation = inline_tools(conversation, tools)
    try:
        text = _compile(template).render(
            messages=conversation,
            tools=tools or None,
            documents=None,
            add_generation_prompt=True,
            **tokenizer.special_tokens,
        )
    except (jinja2.TemplateError, TypeError) as e:  # refused, or a shape it cannot render
        raise InvalidRequest(
            f"the model's chat template refused these messages: {e}.", field
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)


@lru_cache(maxsize=8)
def renders_tools(template: str) -> bool:
    """Whether the template reads its `tools` variable at all."""
    return "tools" in meta.find_undeclared_variables(_ENV.parse(template))


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)
