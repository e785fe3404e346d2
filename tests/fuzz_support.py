"""What the fuzz tests share: their mesh (a tiny chat model whose template refuses unknown
roles) and the Unicode edge cases every text field is tried with."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from mesh_support import Mesh, start_mesh
from support import make_tiny_model

from pdmesh.v1 import generation_pb2 as gen_pb

MAX_MODEL_LEN = 64  # bounds what a valid request can generate, so the fuzz stays quick


def fuzz_mesh(
    tmp_path_factory: pytest.TempPathFactory, eos_token_id: int | None = None
) -> Iterator[Mesh]:
    """A mesh with HTTP on, stopped when the caller's fixture ends. `eos_token_id`: the model's
    EOS (None: it has none; a grammar needs one to end on, so constraints are then refused)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("chat-llama"), "llama")
    if eos_token_id is not None:
        model_config = json.loads((folder / "config.json").read_text())
        model_config["eos_token_id"] = eos_token_id
        (folder / "config.json").write_text(json.dumps(model_config))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role') }}{% endif %}{{ m['role'] }} {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    m = start_mesh(
        "--model",
        str(folder),
        "--kv-cache-tokens",
        "4096",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--disagg-min-tokens",
        "16",
        http=True,
    )
    try:
        yield m
    finally:
        m.stop()


# Valid text that tokenizers and templates find odd: NUL, noncharacters, the last code point, a
# BOM, a combining mark, a right-to-left override, a ZWJ sequence, a character outside the BMP.
ODD_TEXT = [
    "\x00",
    "a\x00b",
    "\uffff",
    "\ufffe",
    "\ufdd0",
    "\U0010ffff",
    "\ufeff",
    "e\u0301",
    "\u202eabc",
    "\U0001f469\u200d\U0001f467",
    "\U0001f600",
    "t1\r\nt2",
    "\u2028",
]
# What JSON's \uD800-\uDFFF escapes decode to when they are not a pair: a Python str that is
# not text (it cannot be UTF-8 encoded).
LONE_SURROGATES = ["\ud800", "\udfff", "a\udc00b", "\udc00\ud800", "t1 \ud83d"]
# Bytes that are not UTF-8, four long (they replace a four-byte marker in a serialized message):
# a surrogate, an overlong "/", a byte UTF-8 never uses, a cut-off sequence, past U+10FFFF.
BAD_UTF8 = [b"\xed\xa0\x80a", b"\xc0\xafaa", b"\xffaaa", b"\xe2\x82aa", b"\xf4\x90\x80\x80"]


MARK = "\x01\x02\x03\x04"  # four bytes on the wire, in no other generated string


def with_mark(field: str) -> gen_pb.GenerateRequest:
    """A valid request whose `field` (a path as bad_utf8_field names it) holds MARK."""
    chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(role="user", content="t1")])
    if field == "chat.messages.content":
        chat.messages[0].content = f"t1 {MARK}"
    if field == "chat.messages.role":
        chat.messages[0].role = MARK
    req = gen_pb.GenerateRequest(sampling=gen_pb.SamplingParams(max_tokens=4))
    if field.startswith("chat."):
        req.chat.CopyFrom(chat)
    else:
        req.text = f"t1 {MARK}" if field == "text" else "t1 t2"
    if field == "sampling.stop":
        req.sampling.stop.append(MARK)
    if field in ("model", "request_id"):
        setattr(req, field, MARK)
    return req


GRPC_TEXT_FIELDS = [
    "text",
    "chat.messages.content",
    "chat.messages.role",
    "sampling.stop",
    "model",
    "request_id",
]


def bad_utf8_payload(field: str, bad: bytes) -> bytes:
    raw = with_mark(field).SerializeToString()
    assert raw.count(MARK.encode()) == 1
    return raw.replace(MARK.encode(), bad)


def post_json(base: str, path: str, body: dict) -> tuple[int, dict]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())  # lone surrogates: \uXXXX
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def http_text_fields(text: str) -> list[tuple[str, dict, str]]:
    """(path, body, param) with `text` in each text field a request may carry."""
    user = {"role": "user", "content": "t1"}
    return [
        (COMPLETIONS, {"prompt": text}, "prompt"),
        (COMPLETIONS, {"prompt": ["t1" + text]}, "prompt"),
        (COMPLETIONS, {"prompt": "t1", "stop": text}, "stop[0]"),
        (COMPLETIONS, {"prompt": "t1", "stop": ["t2", text]}, "stop[1]"),
        (COMPLETIONS, {"prompt": "t1", "model": text}, "model"),
        (CHAT, {"messages": [user, {"role": "user", "content": text}]}, "messages[1].content"),
        (CHAT, {"messages": [{"role": text, "content": "t1"}]}, "messages[0].role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            "messages[0].content",
        ),
        (CHAT, {"messages": [user], "stop": [text]}, "stop[0]"),
    ]
