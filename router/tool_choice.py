"""What a chat request asks of its tools, whichever edge it came through: the definitions the
chat template renders, the constraint structured output enforces, and the parser that reads the
calls back out of the output.

`tool_choice` as OpenAI defines it, with vLLM's choices where OpenAI leaves room:
- "none": no calls. The tools are still rendered (vLLM's default): the model knows them but
  its output is content, never parsed;
- "auto" (the default with tools): the model decides; its calls are parsed out of free text by
  the parser of its format (`--tool-call-parser`, or the one its chat template asks for);
- "required": one or more calls, enforced by structured output: a JSON list of
  `{"name": ..., "parameters": {...}}` objects whose names and parameters follow the tools'
  schemas (vLLM's format, parsed by `RequiredCalls`);
- a function's name: exactly one call of it, its arguments enforced by its parameters' schema.
`parallel_tool_calls` false: at most one call (for "required", a list of one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.router.tool_parsers.base import ToolParser
from pdmesh.router.tool_parsers.forced import NamedCall, RequiredCalls
from pdmesh.router.tool_parsers.registry import parser_names
from pdmesh.sampling_params import StructuredOutputsParams

NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"
MODES = (NONE, AUTO, REQUIRED)
_CONSTRAINT = "structured_outputs."  # the field a worker's refusal of a constraint names


@dataclass(frozen=True)
class ToolUse:
    """tools: checked definitions (pdmesh.text.chat_messages.check_tools), never empty. choice:
    one of MODES, or FUNCTION with `function` naming one of the tools. field: the request's
    name for tool_choice, which refusals name."""

    tools: list[dict[str, Any]]
    choice: str = AUTO
    function: str | None = None
    parallel: bool = True
    field: str = "tool_choice"

    @classmethod
    def make(
        cls,
        tools: list[dict[str, Any]],
        choice: str | None,
        function: str | None = None,
        parallel: bool = True,
        field: str = "tool_choice",
    ) -> ToolUse | None:
        """The request's tool use, or None when it has no tools (choice "none" or "auto" then
        mean nothing; a call it requires cannot be made: InvalidRequest naming `field`)."""
        forced = choice == REQUIRED or function is not None
        if not tools:
            if forced:
                raise InvalidRequest(
                    f"{field} requires a function call, but the request has no tools.", field
                )
            return None
        names = [t["function"]["name"] for t in tools]
        if function is not None and function not in names:
            raise InvalidRequest(
                f"{field} names the function {function!r:.80}, which is not among the "
                f"request's tools ({', '.join(names)[:200]}).",
                field,
            )
        return cls(
            tools, FUNCTION if function is not None else choice or AUTO, function, parallel, field
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema "required" and a named function put on the output, else None."""
        if self.choice == FUNCTION:
            return StructuredOutputsParams(json=_parameters(self._tool(self.function)))
        if self.choice != REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def constrain(self, sampling: dict[str, Any]) -> None:
        """Put the constraint into SamplingParams keyword arguments (InvalidRequest when the
        request constrains its output itself)."""
        constraint = self.constraint()
        if constraint is None:
            return
        if sampling.get("structured_outputs") is not None:
            raise InvalidRequest(
                f"{self.field} {self.choice!r} makes the output a function call; it cannot be "
                "combined with response_format or structured_outputs.",
                self.field,
            )
        sampling["structured_outputs"] = constraint

    def parser(self, auto: type[ToolParser] | None) -> ToolParser | None:
        """A fresh parser for one choice's output (None: "none", the output is content); `auto`
        is the model's format. InvalidRequest for "auto" when the format is not known."""
        max_calls = None if self.parallel else 1
        if self.choice == FUNCTION:
            return NamedCall(self.function or "")
        if self.choice == REQUIRED:
            return RequiredCalls(max_calls)
        if self.choice == NONE:
            return None
        if auto is None:
            raise InvalidRequest(
                f"{self.field} \"auto\" needs the model's tool-call format, and this model's "
                "chat template asks for none that pdmesh knows: start the router with "
                f'--tool-call-parser ({", ".join(parser_names())}), or use "required" or a '
                "named function.",
                self.field,
            )
        return auto(max_calls)

    def refusal(self, exc: Exception) -> Exception:
        """`exc`, or for a worker's refusal of the schema a forced choice put on the output,
        the same naming the tools (the worker knows it as structured_outputs)."""
        forced = self.choice in (REQUIRED, FUNCTION)
        field = exc.field if isinstance(exc, InvalidRequest) else None
        if forced and field is not None and field.startswith(_CONSTRAINT):
            return InvalidRequest(f"the tools' parameters cannot be enforced: {exc}", "tools")
        return exc

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters' schema as the schema of its arguments: an object (OpenAI: no
    parameters is an empty parameter list)."""
    parameters = tool["function"].get("parameters")
    if parameters is None:
        return {"type": "object", "properties": {}}
    return {"type": "object", **parameters}
