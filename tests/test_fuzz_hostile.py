"""Hostile requests at both edges of a running mesh (issue 35), with the generators of
`pdmesh bench --fuzz` (pdmesh/bench/fuzz): a fixed case for every class that once earned a 5xx,
an INTERNAL or a wrong answer, each with the status and the field it must get; a bounded
property-based fuzz over every class on both channels; the structured-output constraints that
used to kill the engine, with innocent requests beside them that must get their undisturbed
text; and at the end, no worker left the rotation or restarted and an innocent request is
answered as before. Every reply must be an answer or a refusal naming the field; a 5xx,
INTERNAL, UNKNOWN, UNAVAILABLE, DEADLINE_EXCEEDED or a hang fails."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fuzz_support import fuzz_mesh
from mesh_support import Mesh

from pdmesh.bench.fuzz import all_cases
from pdmesh.bench.fuzz.checks import Outcome, Reply, check, fuzz
from pdmesh.bench.fuzz.run import Report
from pdmesh.bench.fuzz.structured import grpc_structured, http_structured
from pdmesh.bench.fuzz.values import CHAT, COMPLETIONS, GRPC, HTTP, Case, Raw, dumps
from pdmesh.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.timeout(600)

FUZZ_CASES = 2000  # about 30 s on two cores
STRUCTURED_FUZZ_CASES = 400  # about 15 s
USER = {"role": "user", "content": "t1 t2"}
LONG = "9" * 5000  # past Python's 4,300-digit int-string limit
# Innocent requests: greedy, one prefilled on the decode worker, one by the prefill worker
# (over --disagg-min-tokens 16).
INNOCENT = [
    {"prompt": "t5 t6 t7", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": " ".join(f"t{i}" for i in range(30, 55)), "max_tokens": 12, "temperature": 0},
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from fuzz_mesh(tmp_path_factory, eos_token_id=0)


@pytest.fixture(scope="module")
def baseline(mesh: Mesh) -> list[str]:
    """The innocent requests' texts before any hostile one."""
    return [_reply(mesh, _http(COMPLETIONS, body)).text for body in INNOCENT]


def _http(path: str, body: object, *headers: tuple[str, str]) -> Case:
    data = body if isinstance(body, bytes) else dumps(body)
    return Case("fixed", HTTP, data, path, (("Content-Type", "application/json"), *headers))


def _grpc(request: gen_pb.GenerateRequest) -> Case:
    return Case("fixed", GRPC, request.SerializeToString())


def _text(words: str = "t1 t2", **sampling: object) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(text=words, sampling=gen_pb.SamplingParams(**sampling))


def _reply(mesh: Mesh, case: Case) -> Reply:
    return check(case, mesh.target, mesh.http or "").reply


def _assert_proper(outcomes: list[Outcome]) -> None:
    report = Report(outcomes)
    print(report.table())
    assert not report.failures, report.table()


# -- one case per class, with what it must get -----------------------------------------------
def _deep_schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' + "[" * levels + "]" * levels + "}}"


def _chat(**fields: object) -> gen_pb.GenerateRequest:
    chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(role="user", content="t1")])
    for name, value in fields.items():
        if name == "messages":
            del chat.messages[:]
            chat.messages.extend(value)  # type: ignore[arg-type]
        else:
            getattr(chat, name).extend(value)  # type: ignore[call-overload]
    return gen_pb.GenerateRequest(chat=chat, sampling=gen_pb.SamplingParams(max_tokens=2))


def _structured(**kind: object) -> gen_pb.GenerateRequest:
    request = _text(max_tokens=2)
    request.sampling.structured_outputs.CopyFrom(gen_pb.StructuredOutputs(**kind))
    return request


TOOL_CALL_TURN = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "X"}}],
}
REFUSED = [
    # Integer literals past Python's int-string limit, in every kind of place.
    (
        "long int max_tokens",
        _http(COMPLETIONS, {"prompt": "t1", "max_tokens": Raw(LONG)}),
        "max_tokens",
    ),
    (
        "long int temperature",
        _http(CHAT, {"messages": [USER], "temperature": Raw(LONG)}),
        "temperature",
    ),
    ("long int prompt id", _http(COMPLETIONS, {"prompt": [1, Raw(LONG)]}), "prompt[1]"),
    (
        "long int logit_bias",
        _http(COMPLETIONS, {"prompt": "t1", "logit_bias": {"1": Raw(LONG)}}),
        "logit_bias.1",
    ),
    ("long int unread field", _http(COMPLETIONS, {"prompt": "t1", "user": Raw(LONG)}), "user"),
    (
        "long int in a schema",
        _http(
            CHAT,
            {
                "messages": [USER],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"maxLength": Raw(LONG)}},
                },
            },
        ),
        "response_format.json_schema.schema.maxLength",
    ),
    (
        "long int in a schema, gRPC",
        _grpc(_structured(json='{"maxLength": ' + LONG + "}")),
        "structured_outputs.json.maxLength",
    ),
    # Nesting deeper than 64 levels: in the body, in JSON texts over gRPC.
    (
        "deep body",
        _http(COMPLETIONS, {"prompt": Raw("[" * 900 + "]" * 900)}),
        "prompt[0][0][0][0][0][0][0]",
    ),
    (
        "deep tool parameters",
        _http(
            CHAT,
            {
                "messages": [USER],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"a": Raw("[" * 100 + "]" * 100)}},
                    }
                ],
            },
        ),
        "tools[0].function.parameters.a[0][0][0]",
    ),
    ("deep schema, gRPC", _grpc(_structured(json=_deep_schema(5000))), "structured_outputs.json"),
    (
        "deep schema under the parser's limit, gRPC",
        _grpc(_structured(json=_deep_schema(950))),
        "structured_outputs.json.properties.a" + "[0]" * 6,
    ),
    (
        "deep tool parameters, gRPC",
        _grpc(_chat(tools=[gen_pb.Tool(name="f", parameters=_deep_schema(5000))])),
        "chat.tools[0].parameters",
    ),
    (
        "deep tool parameters under the parser's limit, gRPC",
        _grpc(_chat(tools=[gen_pb.Tool(name="f", parameters=_deep_schema(950))])),
        "chat.tools[0].parameters.properties.a" + "[0]" * 6,
    ),
    # Lone surrogates where nothing checked them before: constraints, tool call arguments.
    (
        "surrogate regex",
        _http(CHAT, {"messages": [USER], "structured_outputs": {"regex": "\ud800"}}),
        "structured_outputs.regex",
    ),
    (
        "surrogate choice",
        _http(CHAT, {"messages": [USER], "structured_outputs": {"choice": ["t1", "a\udc00"]}}),
        "structured_outputs.choice[1]",
    ),
    (
        "surrogate grammar",
        _http(CHAT, {"messages": [USER], "structured_outputs": {"grammar": 'root ::= "\ud800"'}}),
        "structured_outputs.grammar",
    ),
    (
        "surrogate in a schema",
        _http(
            CHAT,
            {
                "messages": [USER],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"enum": ["\ud800"]}},
                },
            },
        ),
        "response_format.json_schema.schema.enum[0]",
    ),
    (
        "surrogate in tool call arguments",
        _http(
            CHAT,
            {
                "messages": [
                    USER,
                    {
                        **TOOL_CALL_TURN,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"a": "\\ud800"}'},
                            }
                        ],
                    },
                ]
            },
        ),
        "messages[1].tool_calls[0].function.arguments.a",
    ),
    (
        "surrogate escape in a schema, gRPC",
        _grpc(_structured(json='{"enum": ["\\ud800"]}')),
        "structured_outputs.json.enum[0]",
    ),
    # Values out of the wire's range, and token ids outside the vocabulary.
    (
        "stop_token_ids 2**63",
        _http(COMPLETIONS, {"prompt": "t1", "stop_token_ids": [2**63]}),
        "stop_token_ids",
    ),
    (
        "stop_token_ids 2**32",
        _http(COMPLETIONS, {"prompt": "t1", "stop_token_ids": [2**32]}),
        "stop_token_ids",
    ),
    (
        "stop_token_ids past the vocabulary",
        _http(COMPLETIONS, {"prompt": "t1", "stop_token_ids": [512]}),
        "stop_token_ids",
    ),
    (
        "logit_bias past the vocabulary",
        _http(COMPLETIONS, {"prompt": "t1", "logit_bias": {"100000": 5}}),
        "logit_bias",
    ),
    ("seed 2**64", _http(COMPLETIONS, {"prompt": "t1", "seed": 2**64}), "seed"),
    ("prompt id 2**64", _http(COMPLETIONS, {"prompt": [2**64]}), "prompt"),
    (
        "stop_token_ids past the vocabulary, gRPC",
        _grpc(_text(max_tokens=2, stop_token_ids=[2**63 - 1])),
        "stop_token_ids",
    ),
    (
        "logit_bias past the vocabulary, gRPC",
        _grpc(_text(max_tokens=2, logit_bias={512: 1.0})),
        "logit_bias",
    ),
    # gRPC holds max_tokens to the context as HTTP does.
    ("max_tokens past the context, gRPC", _grpc(_text("t1 t2 t3", max_tokens=63)), "max_tokens"),
    ("max_tokens 2**63-1, gRPC", _grpc(_text(max_tokens=2**63 - 1)), "max_tokens"),
    # Roles no chat API has.
    (
        "unknown role",
        _http(CHAT, {"messages": [{"role": "wizard", "content": "t1"}]}),
        "messages[0].role",
    ),
    (
        "unknown role, gRPC",
        _grpc(_chat(messages=[gen_pb.ChatMessage(role="wizard", content="t1")])),
        "chat.messages[0].role",
    ),
    # Constraints the grammar library refuses: its messages without its source locations.
    (
        "bad regex",
        _http(CHAT, {"messages": [USER], "structured_outputs": {"regex": "(("}}),
        "structured_outputs.regex",
    ),
    (
        "bad grammar",
        _http(CHAT, {"messages": [USER], "structured_outputs": {"grammar": "root ::= foo"}}),
        "structured_outputs.grammar",
    ),
    (
        "bad schema, gRPC",
        _grpc(_structured(json='{"type": "nonsense"}')),
        "structured_outputs.json",
    ),
]


@pytest.mark.parametrize(
    ("case", "field"), [(c, f) for _, c, f in REFUSED], ids=[n for n, *_ in REFUSED]
)
def test_a_hostile_request_is_refused_naming_the_field(mesh: Mesh, case: Case, field: str) -> None:
    reply = _reply(mesh, case)
    assert reply.problem is None, reply
    assert reply.status in ("http 400", "grpc INVALID_ARGUMENT"), reply
    assert reply.field == field, reply
    assert "internal error" not in reply.message and ".cc:" not in reply.message, reply


BODY = dumps({"prompt": "t1", "max_tokens": 2})
ENCODED = [
    ("gzip", _http(COMPLETIONS, gzip.compress(BODY), ("Content-Encoding", "gzip")), "http 200"),
    (
        "deflate",
        _http(COMPLETIONS, zlib.compress(BODY), ("Content-Encoding", "deflate")),
        "http 200",
    ),
    ("gzip that is not", _http(COMPLETIONS, b"not gzip", ("Content-Encoding", "gzip")), "http 400"),
    (
        "cut-off gzip",
        _http(COMPLETIONS, gzip.compress(BODY)[:-6], ("Content-Encoding", "gzip")),
        "http 400",
    ),
    (
        "deflate that is not",
        _http(COMPLETIONS, b"xxxx", ("Content-Encoding", "deflate")),
        "http 400",
    ),
    ("br", _http(COMPLETIONS, BODY, ("Content-Encoding", "br")), "http 415"),
    ("zstd", _http(COMPLETIONS, BODY, ("Content-Encoding", "zstd")), "http 415"),
    ("unknown coding", _http(COMPLETIONS, BODY, ("Content-Encoding", "foo")), "http 415"),
    (
        "gzip bomb",
        _http(COMPLETIONS, gzip.compress(b" " * (9 * 2**20)), ("Content-Encoding", "gzip")),
        "http 413",
    ),
]


@pytest.mark.parametrize(
    ("case", "status"), [(c, s) for _, c, s in ENCODED], ids=[n for n, *_ in ENCODED]
)
def test_a_body_is_decoded_or_refused_by_its_content_encoding(
    mesh: Mesh, case: Case, status: str
) -> None:
    reply = _reply(mesh, case)
    assert reply.problem is None, reply
    assert reply.status == status, reply
    if status != "http 200":
        assert "request body" in reply.message or "Content-Encoding" in reply.message, reply


def test_fuzzed_requests_get_answers_or_refusals_naming_the_field(
    mesh: Mesh, baseline: list[str]
) -> None:
    outcomes = fuzz(all_cases(), FUZZ_CASES, mesh.target, mesh.http or "")
    _assert_proper(outcomes)
    statuses = {o.status for o in outcomes}
    assert {"http 200", "http 400", "grpc OK", "grpc INVALID_ARGUMENT"} <= statuses


# -- structured output: the engine's half of issue 35 -----------------------------------------
def _with_innocents(mesh: Mesh, cases: list[Case], baseline: list[str]) -> list[Outcome]:
    """`cases` sent together with the innocent requests, whose texts must be the baseline's."""
    innocents = [_http(COMPLETIONS, body) for body in INNOCENT]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(
            pool.map(lambda c: check(c, mesh.target, mesh.http or ""), innocents + cases)
        )
    assert [o.reply.text for o in outcomes[: len(innocents)]] == baseline
    return outcomes[len(innocents) :]


def _squeezed_http(constraint: dict, **sampling: object) -> Case:
    return _http(CHAT, {"messages": [USER], "max_tokens": 8, **constraint, **sampling})


def _squeezed_grpc(so: gen_pb.StructuredOutputs, **sampling: object) -> Case:
    request = _text(**{"max_tokens": 8, **sampling})  # type: ignore[arg-type]
    request.sampling.structured_outputs.CopyFrom(so)
    return _grpc(request)


SELF_REFERENCE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CHOICE = {"structured_outputs": {"choice": ["t1", "t2"]}}
ENGINE_KILLERS = [
    ("choice with min_tokens", _squeezed_http(CHOICE, min_tokens=4)),
    (
        "regex with min_tokens",
        _squeezed_http({"structured_outputs": {"regex": "t1"}}, min_tokens=4),
    ),
    ("choice, tiny temperature and top_p", _squeezed_http(CHOICE, temperature=1e-9, top_p=1e-9)),
    (
        "choice, huge temperature and tiny top_p",
        _squeezed_http(CHOICE, temperature=1e6, top_p=1e-9),
    ),
    (
        "schema that is its own definition",
        _squeezed_http({"structured_outputs": {"json": {"$ref": "#"}}}),
    ),
    (
        "schema that requires itself",
        _squeezed_http(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SELF_REFERENCE}}}
        ),
    ),
    (
        "rule that only refers to itself",
        _squeezed_http({"structured_outputs": {"grammar": "root ::= root"}}),
    ),
    (
        "rule with no way to end",
        _squeezed_http({"structured_outputs": {"grammar": 'root ::= a\na ::= a "t1"'}}),
    ),
    (
        "tool parameters that require themselves",
        _http(
            CHAT,
            {
                "messages": [USER],
                "max_tokens": 8,
                "tool_choice": "required",
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": SELF_REFERENCE}}
                ],
            },
        ),
    ),
    (
        "choice with min_tokens, gRPC",
        _squeezed_grpc(
            gen_pb.StructuredOutputs(choice=gen_pb.Choices(choices=["t1", "t2"])), min_tokens=4
        ),
    ),
    (
        "regex with min_tokens, gRPC",
        _squeezed_grpc(gen_pb.StructuredOutputs(regex="t1"), min_tokens=4),
    ),
    (
        "choice, tiny temperature and top_p, gRPC",
        _squeezed_grpc(
            gen_pb.StructuredOutputs(choice=gen_pb.Choices(choices=["t1", "t2"])),
            temperature=1e-9,
            top_p=1e-9,
        ),
    ),
    (
        "schema that requires itself, gRPC",
        _squeezed_grpc(gen_pb.StructuredOutputs(json=json.dumps(SELF_REFERENCE))),
    ),
    (
        "rule that only refers to itself, gRPC",
        _squeezed_grpc(gen_pb.StructuredOutputs(grammar="root ::= root")),
    ),
]


@pytest.mark.parametrize("case", [c for _, c in ENGINE_KILLERS], ids=[n for n, _ in ENGINE_KILLERS])
def test_structured_output_hostile_specs_fixed(mesh: Mesh, baseline: list[str], case: Case) -> None:
    _assert_proper(_with_innocents(mesh, [case] * 2, baseline))


def test_structured_output_hostile_specs_fuzzed(mesh: Mesh, baseline: list[str]) -> None:
    from hypothesis import strategies as st

    strategy = st.one_of(http_structured(), grpc_structured())
    outcomes = fuzz(strategy, STRUCTURED_FUZZ_CASES, mesh.target, mesh.http or "", seed=1)
    _assert_proper(outcomes)
    _assert_proper(_with_innocents(mesh, [], baseline))


# -- afterwards --------------------------------------------------------------------------------
def test_after_the_fuzz_no_worker_died_and_innocent_requests_are_answered_as_before(
    mesh: Mesh, baseline: list[str]
) -> None:
    metrics = mesh.router_metrics()
    deaths = {
        labels: value
        for (name, labels), value in metrics.items()
        if name in ("pdmesh_router_worker_down_total", "pdmesh_router_worker_restarts_total")
        and value
    }
    assert not deaths, deaths
    assert all(
        value == 1 for (name, _), value in metrics.items() if name == "pdmesh_router_worker_up"
    )
    # Every request, refused, cancelled or answered, gave back what the router booked for it.
    streams = [v for (name, _), v in metrics.items() if name == "pdmesh_router_worker_streams"]
    assert streams and not any(streams), streams
    assert mesh.proc.poll() is None
    assert not any("exited (code" in line for line in mesh.output), mesh.output[-20:]
    assert [_reply(mesh, _http(COMPLETIONS, body)).text for body in INNOCENT] == baseline
