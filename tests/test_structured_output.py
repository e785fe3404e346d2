"""Structured output offline (`SamplingParams(structured_outputs=...)`, xgrammar): every output
obeys its JSON schema, regex, choice or EBNF grammar on the default model; constraints that
cannot be enforced are refused naming the field, and the engine goes on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdmesh import LLM, SamplingParams
from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def _chat_text(llm: LLM, question: str, so: SO, temperature: float = 0) -> str:
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=1, structured_outputs=so)
    out = llm.chat([{"role": "user", "content": question}], params)[0].outputs[0]
    assert out.finish_reason == "stop", out  # the grammar ended, not the token budget
    return out.text


def test_json_schema_and_json_object(default_llm: LLM) -> None:
    text = _chat_text(default_llm, "Describe a user of a website as JSON.", SO(json=PERSON))
    jsonschema.validate(json.loads(text), PERSON)
    question = 'Reply with a JSON object with one key, "city", whose value is Paris.'
    text = _chat_text(default_llm, question, SO(json_object=True))
    assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar(default_llm: LLM) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    assert re.fullmatch(phone, _chat_text(default_llm, "A phone number?", SO(regex=phone)))
    choices = ("Paris", "London", "Rome")
    answer = _chat_text(default_llm, "The capital of Italy?", SO(choice=choices))
    assert answer in choices
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    text = _chat_text(default_llm, "What is 6 times 7?", SO(grammar=grammar), temperature=1.0)
    assert re.fullmatch(r"The answer is [0-9]+\.", text)


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (lambda: SO(regex="(unclosed"), "structured_outputs.regex"),
        (lambda: SO(json={"type": 5}), "structured_outputs.json"),
        (lambda: SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
        (lambda: SO(regex="a", choice=["b"]), "structured_outputs"),
        (lambda: SO(), "structured_outputs"),
        (lambda: SO(choice=[]), "structured_outputs.choice"),
    ],
)
def test_constraints_that_cannot_be_enforced_are_refused(default_llm: LLM, so, field) -> None:
    with pytest.raises(InvalidRequest) as caught:
        default_llm.generate("Hello", SamplingParams(max_tokens=4, structured_outputs=so()))
    assert caught.value.field == field
    # The engine goes on.
    assert default_llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_compilation_past_the_bound_is_refused(default_llm: LLM, monkeypatch) -> None:
    from pdmesh.engine.sample import structured

    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 1e-4)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}}
    with pytest.raises(InvalidRequest, match="took more than") as caught:
        default_llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=SO(json=schema)))
    assert caught.value.field == "structured_outputs.json"
    assert default_llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_an_empty_schema_is_any_json(default_llm: LLM) -> None:
    """`json={}` sets the json constraint (it is not None), as the validation counts it."""
    assert SO(json={}).kind == "json"
    assert default_llm.engine.grammars.matcher(SO(json={})) is not None
