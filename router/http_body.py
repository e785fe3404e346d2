"""An HTTP request's body as the gateway reads it: its content coding undone within the size
limit, then parsed as JSON within limits (`pdmesh.json_input`).

aiohttp's own decompression is off (the gateway's runner passes `auto_decompress=False`): it
raises, for a gzip body that does not inflate, an exception a handler cannot tell from a bug,
and answers an encoding it has no library for (br, zstd) with a plain-text 400 before any
handler runs. Here `identity`, `gzip` and `deflate` are read, in the order the header lists
them; a body that does not decode is 400, any other coding 415 naming those accepted, and a body
that inflates past MAX_BODY_BYTES 413, as a plain body of that size is.
"""

from __future__ import annotations

import zlib
from typing import Any, ClassVar

from aiohttp import hdrs, web

from pdmesh.errors import InvalidRequest
from pdmesh.json_input import parse_json

MAX_BODY_BYTES = 8 * 1024 * 1024  # a prompt of ~2M tokens: far past any model's context
_WBITS = {  # zlib's window bits for each coding (16+: a gzip header and trailer)
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
ACCEPTED_CODINGS = ("identity", *_WBITS)


class UnsupportedEncoding(InvalidRequest):
    """A Content-Encoding the gateway does not read (HTTP's 415)."""

    http_status: ClassVar[int] = 415


class BodyTooLarge(InvalidRequest):
    """A body past MAX_BODY_BYTES once inflated (HTTP's 413)."""

    http_status: ClassVar[int] = 413


def too_large() -> BodyTooLarge:
    return BodyTooLarge(f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB.")


async def read_json(request: web.Request) -> Any:
    """The body's JSON value. InvalidRequest (400, 413, 415) for a body that cannot be read."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # over the application's client_max_size
        raise too_large() from None
    return parse_json(decode(raw, request.headers.get(hdrs.CONTENT_ENCODING, "")))


def decode(raw: bytes, content_encoding: str) -> bytes:
    """`raw` with the codings of a Content-Encoding header undone (the last listed first)."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        wbits = _WBITS.get(coding)
        if wbits is None:
            raise UnsupportedEncoding(
                f"Content-Encoding {coding!r:.40} is not supported; send the request body as "
                f"{', '.join(ACCEPTED_CODINGS)}."
            )
        raw = _inflate(raw, coding, wbits)
    return raw


def _inflate(raw: bytes, coding: str, wbits: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error as e:
        if coding == "deflate" and wbits > 0:  # some clients send deflate without its header
            return _inflate(raw, coding, -zlib.MAX_WBITS)
        raise InvalidRequest(f"the request body is not valid {coding} data ({e}).") from None
    if len(out) > MAX_BODY_BYTES:
        raise too_large()
    if not inflater.eof:
        raise InvalidRequest(f"the request body ends before its {coding} data does.")
    if inflater.unused_data:
        raise InvalidRequest(f"the request body has bytes after the end of its {coding} data.")
    return out
