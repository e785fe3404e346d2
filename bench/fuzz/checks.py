"""Judging one fuzz case's reply, and sending many (`fuzz`: drawn from a hypothesis strategy,
eight at a time).

A reply passes when it is a well-formed answer or a proper refusal: 200 / OK ending with a
finish reason, or a 4xx / INVALID_ARGUMENT whose error names the field (OpenAI's `param`, the
`pdmesh-field` trailer; a body that is not JSON at all names the body), with no grammar-library
source locations in its text. A 5xx, INTERNAL, UNKNOWN, UNAVAILABLE or DEADLINE_EXCEEDED, a
hang and a closed connection are failures.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import grpc

from pdmesh.bench.fuzz.values import GRPC, Case
from pdmesh.errors import FIELD_METADATA
from pdmesh.v1 import generation_pb2 as gen_pb

CONCURRENCY = 8
CASE_TIMEOUT_S = 60.0  # a request not answered within this is a hang
PROPER_HTTP = frozenset({200, 400, 404, 405, 413, 415, 429})
PROPER_GRPC = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
FINISHED_PB = (
    gen_pb.FINISH_REASON_STOP,
    gen_pb.FINISH_REASON_LENGTH,
    gen_pb.FINISH_REASON_TOOL_CALLS,
)
FINISHED = ("stop", "length", "tool_calls")
# What a grammar library's messages carry and a client must never see.
SOURCE_LOCATION = re.compile(r"\.(cc|cpp|h|hpp):\d+|/project/|Check failed")
# Statuses that are about no field: an unknown path or method, overload (429, with Retry-After).
UNNAMED = (404, 405, 429)
# Refusals of a whole body (not JSON, wrong encoding, too large) name it rather than a field.
BODY_LEVEL = ("the request body", "Content-Encoding", "the request is not a valid message")


@dataclass(frozen=True)
class Reply:
    """What came back. status: "http 400", "grpc INVALID_ARGUMENT", "http hang", ...; field: the
    field a refusal names (OpenAI's `param`, the `pdmesh-field` trailer); text: the generated
    text of an answer; problem: why the reply is a failure (None: a proper one)."""

    status: str
    field: str | None = None
    message: str = ""
    text: str = ""
    problem: str | None = None


@dataclass(frozen=True)
class Outcome:
    case: Case
    reply: Reply

    @property
    def status(self) -> str:
        return self.reply.status

    @property
    def problem(self) -> str | None:
        return self.reply.problem


def check(case: Case, target: str, http_base: str, timeout_s: float = CASE_TIMEOUT_S) -> Outcome:
    """Send one case to its edge and judge the reply."""
    if case.channel == GRPC:
        return Outcome(case, send_grpc(target, case, timeout_s))
    return Outcome(case, send_http(http_base, case, timeout_s))


def send_http(base: str, case: Case, timeout_s: float = CASE_TIMEOUT_S) -> Reply:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout_s)
    try:
        conn.request("POST", case.path, body=case.body, headers=dict(case.headers))
        r = conn.getresponse()
        status, content_type, data = r.status, r.getheader("Content-Type", ""), r.read()
    except TimeoutError:
        return Reply("http hang", problem=f"no answer within {timeout_s:.0f} s")
    except (ConnectionError, http.client.HTTPException) as e:
        return Reply("http closed", problem=f"the connection failed: {e!r}")
    finally:
        conn.close()
    name = f"http {status}"
    if status not in PROPER_HTTP:
        return Reply(name, problem=f"status {status}: {data[:300]!r}")
    if status != 200:
        return _refusal(name, status, data)
    if content_type.startswith("text/event-stream"):
        return _stream(name, data)
    try:
        choice = json.loads(data)["choices"][0]
        finish = choice["finish_reason"]
        text = choice.get("text", choice.get("message", {}).get("content")) or ""
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return Reply(name, problem=f"a 200 that is no completion: {data[:300]!r}")
    return Reply(name, text=text, problem=None if finish in FINISHED else f"finish {finish!r}")


def _refusal(name: str, status: int, data: bytes) -> Reply:
    try:
        error = json.loads(data)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        return Reply(name, problem=f"a {status} without OpenAI's error body: {data[:300]!r}")
    problem = None
    if SOURCE_LOCATION.search(message):
        problem = f"a source location in the message: {message[:300]!r}"
    elif not message:
        problem = "an empty error message"
    elif not param and status not in UNNAMED and not message.startswith(BODY_LEVEL):
        problem = f"a {status} naming no field: {message[:300]!r}"
    return Reply(name, param, message, problem=problem)


def _stream(name: str, data: bytes) -> Reply:
    events = [e[6:] for e in data.decode(errors="replace").split("\n\n") if e.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return Reply(name, problem=f"a stream that does not end with [DONE]: {data[-300:]!r}")
    texts = []
    for event in events[:-1]:
        chunk = json.loads(event)
        error = chunk.get("error")
        if error is not None and (error.get("code") or 500) >= 500:
            return Reply(name, problem=f"an error event in the stream: {error}")
        for choice in chunk.get("choices") or ():
            texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return Reply(name, text="".join(texts))


def send_grpc(target: str, case: Case, timeout_s: float = CASE_TIMEOUT_S) -> Reply:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(
            case.path,
            request_serializer=None,
            response_deserializer=gen_pb.GenerateResponse.FromString,
        )
        try:
            replies = list(call(case.body, timeout=timeout_s))
        except grpc.RpcError as e:
            return _grpc_error(e)
    text = "".join(r.text for r in replies)
    if not replies or replies[-1].finish_reason not in FINISHED_PB:
        return Reply("grpc OK", text=text, problem="a stream that ends without a finish reason")
    return Reply("grpc OK", text=text)


def _grpc_error(e: grpc.RpcError) -> Reply:
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA)  # type: ignore[attr-defined]
    reply = Reply(f"grpc {code.name}", field, details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return replace(reply, problem="no answer within the deadline (a hang)")
    if code not in PROPER_GRPC:
        return replace(reply, problem=f"{code.name}: {details[:300]!r}")
    if SOURCE_LOCATION.search(details):
        return replace(reply, problem=f"a source location in the message: {details[:300]!r}")
    names = field or code is grpc.StatusCode.RESOURCE_EXHAUSTED or details.startswith(BODY_LEVEL)
    return replace(reply, problem=None if names else f"names no field: {details[:300]!r}")


def run_cases(
    cases: Iterable[Case], target: str, http_base: str, concurrency: int = CONCURRENCY
) -> list[Outcome]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda c: check(c, target, http_base), cases))


def fuzz(
    strategy: object,
    num_cases: int,
    target: str,
    http_base: str,
    seed: int = 0,
    on_batch: Callable[[list[Outcome]], None] | None = None,
) -> list[Outcome]:
    """`num_cases` cases drawn from the hypothesis `strategy`, sent CONCURRENCY at a time;
    every outcome, failures included (no shrinking: a failure is reported with the request that
    caused it). One case per example: a list of them would outgrow hypothesis' budget for one
    example, and it would then draw only the smallest cases."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    outcomes: list[Outcome] = []
    pending: list[Case] = []

    def send() -> None:
        done = run_cases(pending, target, http_base)
        pending.clear()
        outcomes.extend(done)
        if on_batch is not None:
            on_batch(done)

    @with_seed(seed)
    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw(case: Case) -> None:
        pending.append(case)
        if len(pending) == CONCURRENCY:
            send()

    draw()
    if pending:
        send()
    return outcomes
