"""What every fuzz case is made of: `Case` (one request for one edge), JSON bodies with raw
fragments (`Raw`, `dumps`), and the hostile values the strategies of `openai.py`,
`generate.py` and `structured.py` draw from. Prompts use the words `t0` .. `t511` (the tests'
tiny models spell each token so; any model tokenizes them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from hypothesis import strategies as st

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/pdmesh.v1.Generation/Generate"
HTTP, GRPC = "http", "grpc"
MAX_BODY_BYTES = 8 * 1024 * 1024  # the gateway's limit (router/http_body.py)


@dataclass(frozen=True)
class Case:
    """One request: `body` is the HTTP body or the serialized GenerateRequest."""

    kind: str
    channel: str  # HTTP or GRPC
    body: bytes
    path: str = GENERATE
    headers: tuple[tuple[str, str], ...] = field(default=(("Content-Type", "application/json"),))

    def describe(self, limit: int = 300) -> str:
        """What the case sends, short enough for a report."""
        where = f"{self.channel} {self.path}"
        extra = [f"{k}: {v}" for k, v in self.headers if k != "Content-Type"]
        body = repr(self.body[:limit]) + ("..." if len(self.body) > limit else "")
        return f"{where} [{self.kind}] {' '.join(extra)} {body} ({len(self.body):,} bytes)"


# -- JSON bodies with raw fragments ------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as is (a literal json.dumps cannot write: thousands of digits,
    nesting deeper than Python's recursion limit, invalid escapes)."""

    text: str


def dumps(body: Any) -> bytes:
    """`body` as JSON text with its `Raw` values spliced in; lone surrogates are written as
    their escapes, NaN and infinities bare (as Python's json does)."""
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(body))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw, 1)
    return text.encode()


def deep_array(levels: int) -> Raw:
    return Raw("[" * levels + "]" * levels)


def deep_object(levels: int) -> Raw:
    return Raw('{"a":' * levels + "1" + "}" * levels)


# -- values ------------------------------------------------------------------------------------
LONG_INTS = [Raw("1" * 41), Raw("9" * 400), Raw("9" * 4301), Raw("-" + "7" * 5000)]
INT_EDGES = [0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**40]
FLOAT_EDGES = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-300, 5e-324, 1e308]
ODD_TEXT = [
    "",
    "\x00",
    "a\x00b",
    "\uffff",
    "\U0010ffff",
    "\ufeff",
    "e\u0301",
    "\u202eabc",
    "\u2028",
]
LONE_SURROGATES = ["\ud800", "\udfff", "a\udc00b", "t1 \ud83d"]
WORDS = st.lists(st.integers(0, 511).map(lambda i: f"t{i}"), min_size=1, max_size=20).map(" ".join)
TEXT = st.one_of(
    WORDS,
    st.text(max_size=40),
    st.sampled_from(ODD_TEXT + LONE_SURROGATES),
    st.integers(1, 5000).map(lambda n: "t1 " * n),
)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INT_EDGES),
    st.integers(),
    st.floats(),
    st.sampled_from(FLOAT_EDGES),
    TEXT,
)
JSON_VALUE = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
DEEP = st.one_of(
    st.sampled_from([63, 64, 65, 100, 999, 1000, 5000]).map(deep_array),
    st.sampled_from([63, 64, 65, 1000]).map(deep_object),
)
HOSTILE = st.one_of(SCALAR, st.sampled_from(LONG_INTS), DEEP, JSON_VALUE)
NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
)
TOKEN_KEY = st.one_of(
    st.integers(-5, 2**64).map(str), st.text(max_size=6), st.sampled_from(["1" * 41, "-1", " 1"])
)
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    **{name: HOSTILE for name in NUMBER_FIELDS},
    "logit_bias": st.one_of(
        st.dictionaries(TOKEN_KEY, HOSTILE, max_size=4),
        st.integers(1000, 2000).map(lambda n: {str(i): 1 for i in range(n)}),
        HOSTILE,
    ),
    "stop": st.one_of(
        TEXT, st.lists(TEXT, max_size=20), st.just(["x" * 2000]), st.lists(HOSTILE, max_size=3)
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.one_of(st.sampled_from(INT_EDGES), st.integers(0, 2000)), max_size=5),
        st.just(list(range(1100))),
        HOSTILE,
    ),
    "ignore_eos": HOSTILE,
    "skip_special_tokens": HOSTILE,
    "echo": HOSTILE,
    "stream": HOSTILE,
    "stream_options": st.one_of(st.just({"include_usage": True}), HOSTILE),
    "model": st.one_of(TEXT, HOSTILE),
    "user": HOSTILE,
}


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy:
    """`good` three times in four: the hostility sits deeper than the outer shape."""
    return st.integers(0, 3).flatmap(lambda i: good if i else bad)


def fields(names: tuple[str, ...] | list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """One to three of these fields, each with a hostile value."""
    pair = st.sampled_from(sorted(names)).flatmap(lambda k: st.tuples(st.just(k), FIELD_VALUES[k]))
    return st.lists(pair, min_size=1, max_size=3).map(dict)


def valid_base(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    """A request that is served: a few words of prompt, a few tokens of output."""

    def body(words: str, n: int) -> dict[str, Any]:
        prompt = {"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words}
        return {**prompt, "max_tokens": n}

    return st.builds(body, WORDS, st.integers(1, 8))


def http_case(kind: str, path: str, body: st.SearchStrategy[Any]) -> st.SearchStrategy[Case]:
    return body.map(lambda b: Case(kind, HTTP, dumps(b), path))


def merged(base: st.SearchStrategy[dict], extra: st.SearchStrategy[dict]) -> st.SearchStrategy:
    return st.builds(lambda b, e: {**b, **e}, base, extra)


ROLES = ["system", "developer", "user", "assistant", "tool", "function", "ipython", "", "USER"]


@cache
def _big_schema() -> dict[str, Any]:
    """A schema past the 64 KiB limit on structured-output specs."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}


HOSTILE_SCHEMAS: list[Any] = [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "string", "pattern": "(a+)+$"},
    {"type": "string", "pattern": "(("},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"enum": []},
    {"type": []},
    {"type": "nonsense"},
    {"type": "string", "minLength": 10**9},
    {"type": "array", "minItems": 10**6},
    {"not": {}},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "string", "enum": ["\ud800"]},
    {"type": "object", "required": ["x"], "additionalProperties": False},
    Raw('{"type":"object","properties":{"a":' * 70 + "{}" + "}}" * 70),
    Raw('{"type":"integer","maximum":' + "9" * 5000 + "}"),
]
SCHEMA = st.one_of(
    st.sampled_from(HOSTILE_SCHEMAS),
    st.sampled_from(HOSTILE_SCHEMAS),
    st.builds(_big_schema),
    st.just({"type": "object"}),
    HOSTILE,
)


def utf8(s: str) -> bool:
    """Protobuf strings must be UTF-8 (the client refuses to send others)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


PB_TEXT = TEXT.filter(utf8)


JSON_TEXT = st.one_of(
    st.just(""),
    TEXT,
    st.sampled_from(
        [
            "[" * 5000 + "]" * 5000,
            '{"a":' * 70 + "1" + "}" * 70,
            '{"type": "integer", "maximum": ' + "9" * 5000 + "}",
            '{"type": "string", "enum": ["\\ud800"]}',
            '{"\\udc00": 1}',
            "{",
            "NaN",
            json.dumps(_big_schema()),
        ]
    ),
    st.sampled_from([s for s in HOSTILE_SCHEMAS if not isinstance(s, Raw)]).map(json.dumps),
)

PB_JSON_TEXT = JSON_TEXT.filter(utf8)


def grpc_case(kind: str, request: st.SearchStrategy[Any]) -> st.SearchStrategy[Case]:
    return request.map(lambda r: Case(kind, GRPC, r.SerializeToString()))
