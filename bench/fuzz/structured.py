"""Structured-output constraints meant to leave the engine no token to sample or no way to
end (the engine's half of issue 35), on both edges: choice or regex with min_tokens, choice
with extreme temperature and a tiny top_p, self-referential schemas and grammar rules,
invalid and catastrophic regexes. Kept apart from the other classes: the CI test runs them in
test functions of their own."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from pdmesh.bench.fuzz.values import (
    CHAT,
    HOSTILE,
    JSON_TEXT,
    SCHEMA,
    TEXT,
    WORDS,
    Case,
    grpc_case,
    http_case,
    utf8,
    valid_base,
)
from pdmesh.v1 import generation_pb2 as gen_pb

# Spelled with the tiny models' tokens (t0 .. t511, which a grammar sees without spaces): a
# constraint a model can write, so that it reaches the sampler; any model can write these.
REGEXES = [
    "(t1|t1t1)*t2",
    "((t1)+)+$",
    "(t1t2t3)+",
    "t[0-9]",
    "t1",
    "((",
    "(?=t)t1",
    "[^\\s\\S]",
    "(t1){1000000}",
]
GRAMMARS = [
    "root ::= root",
    'root ::= a\na ::= a "t1"',
    'root ::= "t1" root',
    "root ::= foo",
    'root ::= "t1" | "t2"',
    'root ::= ("t1")*',
    'root ::= "t1" x\nx ::= x',
]
CHOICES = st.one_of(
    st.sampled_from([["t1"], ["t1", "t2"], ["t1t2t3"], ["t1", "t1t2"], [], [""], ["\ud800"]]),
    st.lists(TEXT, max_size=4),
)
CONSTRAINT = st.one_of(
    st.builds(lambda r: {"structured_outputs": {"regex": r}}, st.sampled_from(REGEXES)),
    st.builds(lambda g: {"structured_outputs": {"grammar": g}}, st.sampled_from(GRAMMARS)),
    st.builds(lambda c: {"structured_outputs": {"choice": c}}, CHOICES),
    st.builds(lambda s: {"structured_outputs": {"json": s}}, SCHEMA),
    st.builds(
        lambda s: {"response_format": {"type": "json_schema", "json_schema": {"schema": s}}},
        SCHEMA,
    ),
    st.builds(
        lambda k, v: {k: v}, st.sampled_from(["response_format", "structured_outputs"]), HOSTILE
    ),
)


def _squeezed(kw: dict[str, Any]) -> dict[str, Any]:
    """max_tokens at least min_tokens: the constraint, not the lengths, is what is refused."""
    if "min_tokens" in kw:
        kw["max_tokens"] = kw["min_tokens"] + kw.get("max_tokens", 0)
    return kw


# What leaves a constraint no token to sample or no way to end.
SQUEEZE = st.fixed_dictionaries(
    {},
    optional={
        "min_tokens": st.integers(1, 8),
        "max_tokens": st.integers(1, 8),
        "temperature": st.sampled_from([0, 1e-9, 1e-6, 1e6, 1e30]),
        "top_p": st.sampled_from([1e-9, 1e-6, 0.01]),
        "top_k": st.sampled_from([1, 2]),
        "logit_bias": st.sampled_from([{"0": -100}, {"0": 100}, {"1": 100}]),
        "presence_penalty": st.sampled_from([-2, 2]),
        "repetition_penalty": st.sampled_from([1e-3, 10]),
        "seed": st.integers(0, 3),
    },
).map(_squeezed)


def http_structured() -> st.SearchStrategy[Case]:
    base = valid_base(True)
    return http_case(
        "structured", CHAT, st.builds(lambda b, c, s: {**b, **c, **s}, base, CONSTRAINT, SQUEEZE)
    )


def grpc_structured() -> st.SearchStrategy[Case]:
    constraint = st.one_of(
        st.builds(gen_pb.StructuredOutputs, regex=st.sampled_from(REGEXES)),
        st.builds(gen_pb.StructuredOutputs, grammar=st.sampled_from(GRAMMARS)),
        st.builds(
            lambda c: gen_pb.StructuredOutputs(choice=gen_pb.Choices(choices=c)),
            CHOICES.map(lambda cs: [c for c in cs if utf8(c)]),
        ),
        st.builds(gen_pb.StructuredOutputs, json=JSON_TEXT.filter(utf8)),
    )
    squeeze = SQUEEZE.map(
        lambda kw: {
            k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
            for k, v in kw.items()
        }
    )

    def build(
        so: gen_pb.StructuredOutputs, kw: dict[str, Any], words: str
    ) -> gen_pb.GenerateRequest:
        sampling = gen_pb.SamplingParams(**{"max_tokens": 8, **kw})
        sampling.structured_outputs.CopyFrom(so)
        return gen_pb.GenerateRequest(text=words, sampling=sampling)

    return grpc_case("structured", st.builds(build, constraint, squeeze, WORDS))
