"""Tool-call parsers by name (`--tool-call-parser`), and the one a chat template asks for."""

from __future__ import annotations

from collections.abc import Callable

from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.text.chat_template import renders_tools

_PARSERS: dict[str, type[ToolParser]] = {}
DEFAULT = "hermes"  # the format pdmesh writes tools in for templates that do not render them


def register_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return deco


def _load() -> dict[str, type[ToolParser]]:
    from pdmesh.router.tool_parsers import hermes, llama3_json  # noqa: F401 (registers them)

    return _PARSERS


def parser_names() -> list[str]:
    return sorted(_load())


def get_parser(name: str) -> type[ToolParser]:
    parsers = _load()
    if name not in parsers:
        raise ValueError(
            f"unknown tool-call parser {name!r} (--tool-call-parser); available: "
            f"{', '.join(sorted(parsers))}."
        )
    return parsers[name]


def pick_parser(name: str | None, chat_template: str | None) -> type[ToolParser] | None:
    """The parser `name`s, else the one whose format the chat template asks for (in
    registration order, Hermes first: Qwen's templates mention "parameters" too); a template
    that never reads `tools` gets the tools in the Hermes format (pdmesh.text.tool_prompt), so
    the Hermes parser; None when the template's format is not known."""
    if name:
        return get_parser(name)
    if chat_template is None:
        return None
    parsers = _load()
    if not renders_tools(chat_template):
        return parsers[DEFAULT]
    return next((p for p in parsers.values() if p.matches_template(chat_template)), None)
