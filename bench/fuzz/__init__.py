"""Hostile requests for both edges of a mesh, as hypothesis strategies, and the fuzz that sends
them: what `tests/test_fuzz_hostile.py` draws a bounded number of (CI) and `pdmesh bench
--fuzz` thousands (run.py). Each strategy draws `Case`s of one class (`Case.kind`): the OpenAI
bodies of /v1/completions and /v1/chat/completions (openai.py), the gRPC `GenerateRequest`
(generate.py), and the structured-output constraints meant to break the engine (structured.py).
`checks.py` judges a reply."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from pdmesh.bench.fuzz.generate import grpc_requests
from pdmesh.bench.fuzz.openai import (
    http_encoding,
    http_json,
    http_messages,
    http_sampling,
    http_tools,
)
from pdmesh.bench.fuzz.structured import grpc_structured, http_structured
from pdmesh.bench.fuzz.values import Case


def all_cases(structured: bool = False) -> st.SearchStrategy[Case]:
    """Every class on both channels; the structured-output class only when asked."""
    parts = [
        http_sampling(),
        http_messages(),
        http_tools(),
        http_json(),
        http_encoding(),
        grpc_requests(),
    ]
    if structured:
        parts += [http_structured(), grpc_structured()]
    return st.one_of(*parts)


def run_fuzz_bench(args: Any) -> int:
    """`pdmesh bench --fuzz` (run.py)."""
    from pdmesh.bench.fuzz.run import run_fuzz_bench as run

    return run(args)
