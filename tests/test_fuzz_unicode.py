"""Unicode edge cases on every text field of both edges of a running mesh: JSON's lone-surrogate
escapes (valid JSON, not text) are 400 naming the field, bytes that are not UTF-8 in a protobuf
string are INVALID_ARGUMENT naming the field, and odd but valid text (NUL, noncharacters,
U+10FFFF, combining marks) is served."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from fuzz_support import (
    BAD_UTF8,
    CHAT,
    COMPLETIONS,
    GRPC_TEXT_FIELDS,
    LONE_SURROGATES,
    MARK,
    ODD_TEXT,
    bad_utf8_payload,
    fuzz_mesh,
    http_text_fields,
    post_json,
    with_mark,
)
from mesh_support import Mesh

from pdmesh.v1 import generation_pb2 as gen_pb

FINISHED = (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from fuzz_mesh(tmp_path_factory)


@pytest.mark.parametrize("text", LONE_SURROGATES)
def test_lone_surrogates_are_400_naming_the_field(mesh: Mesh, text: str) -> None:
    assert mesh.http is not None
    for path, body, param in http_text_fields(text):
        status, reply = post_json(mesh.http, path, {**body, "max_tokens": 2})
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == param, (body, reply)
        assert "not valid Unicode text" in reply["error"]["message"]
    # Where the text is not read (an extra field, a string in a refused field), it is harmless.
    status, _ = post_json(mesh.http, COMPLETIONS, {"prompt": "t1", "max_tokens": 2, "user": text})
    assert status == 200
    status, reply = post_json(
        mesh.http,
        CHAT,
        {
            "messages": [{"role": "user", "content": "t1"}],
            "tools": [{"type": "function", "function": {"name": text}}],
        },
    )
    assert status == 400 and reply["error"]["param"] == "tools[0].function.name"
    tool = {"type": "function", "function": {"name": "f", "description": text}}
    status, reply = post_json(
        mesh.http, CHAT, {"messages": [{"role": "user", "content": "t1"}], "tools": [tool]}
    )
    assert status == 400 and reply["error"]["param"] == "tools[0].function.description"
    assert "not valid Unicode text" in reply["error"]["message"]


@pytest.mark.parametrize("text", ODD_TEXT)
def test_odd_but_valid_text_is_served_in_every_field(mesh: Mesh, text: str) -> None:
    assert mesh.http is not None
    for path, body, param in http_text_fields(text):
        status, reply = post_json(mesh.http, path, {**body, "max_tokens": 2})
        # Served, or refused for what the text says (an unknown role, another model), never
        # for being odd text, and never a 500.
        assert status in (200, 400), (body, reply)
        if status == 400:
            assert "Unicode" not in reply["error"]["message"], (body, reply)
            assert param in ("model", "messages[0].role", "prompt") or "refused" in str(reply)


@pytest.mark.parametrize("field", GRPC_TEXT_FIELDS)
def test_grpc_strings_that_are_not_utf8_are_invalid_argument_naming_the_field(
    mesh: Mesh, field: str
) -> None:
    with grpc.insecure_channel(mesh.target) as channel:
        call = channel.unary_stream(
            "/pdmesh.v1.Generation/Generate",
            request_serializer=None,
            response_deserializer=gen_pb.GenerateResponse.FromString,
        )
        for bad in BAD_UTF8:
            with pytest.raises(grpc.RpcError) as err:
                list(call(bad_utf8_payload(field, bad), timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field} is not valid UTF-8" in (err.value.details() or "")
        ok = list(
            call(with_mark("text").SerializeToString().replace(MARK.encode(), b"t2 t"), timeout=60)
        )
        assert ok[-1].finish_reason in FINISHED
