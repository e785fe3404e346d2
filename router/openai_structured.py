"""OpenAI's `response_format` and vLLM's `structured_outputs` body field -> the constraint a
request's output must obey (`StructuredOutputsParams`), shapes checked, each refusal naming the
field. Whether a schema can be enforced is decided where it is compiled (the workers' engines).
"""

from __future__ import annotations

from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import StructuredOutputsParams
from pdmesh.validation import check_structured


def structured_from_body(body: dict[str, Any]) -> StructuredOutputsParams | None:
    fmt = body.get("response_format")
    extra = body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise InvalidRequest(
            "set response_format or structured_outputs, not both.", "structured_outputs"
        )
    if extra is not None:
        return _vllm(extra)
    return None if fmt is None else _response_format(fmt)


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object.",
                "response_format.json_schema.schema",
            )
        # strict or not, the schema is enforced at every token.
        so = StructuredOutputsParams(json=schema)
        check_structured(so, "response_format.json_schema.schema")
        return so
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, got {kind!r:.50}.",
        "response_format.type",
    )


def _vllm(extra: Any) -> StructuredOutputsParams:
    kinds = StructuredOutputsParams.KINDS
    if not isinstance(extra, dict) or set(extra) - set(kinds):
        raise InvalidRequest(
            f"structured_outputs must be an object with one of {', '.join(kinds)}.",
            "structured_outputs",
        )
    choice = extra.get("choice")
    if choice is not None and not isinstance(choice, list):
        raise InvalidRequest(
            "structured_outputs.choice must be a list of strings.", "structured_outputs.choice"
        )
    if not isinstance(extra.get("json_object", False), bool):
        raise InvalidRequest(
            "structured_outputs.json_object must be true or false.",
            "structured_outputs.json_object",
        )
    return StructuredOutputsParams(**extra)
