"""API keys on the public API: `authorization: Bearer <key>` in gRPC metadata or the HTTP header.

Keys are compared in constant time. Health checks stay open (orchestrators probe without a key);
every other method of a server built with `ApiKeyInterceptor` needs a key, reflection included.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdmesh.serving.errors import HandlerInterceptor, with_behavior

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_BEARER = "bearer "
MIN_KEY_LEN = 8


@dataclass(frozen=True)
class ApiKeys:
    """The keys a client may present; empty: no key is needed."""

    keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in self.keys:
            if len(key) < MIN_KEY_LEN or any(c.isspace() for c in key) or not key.isprintable():
                raise ValueError(
                    f"an API key must be at least {MIN_KEY_LEN} printable characters without "
                    "spaces (e.g. `openssl rand -hex 16`)."
                )

    @classmethod
    def from_flags(cls, keys: str | None, keys_file: str | None) -> ApiKeys:
        """Comma-separated keys (--api-keys / PDMESH_API_KEYS) and a file of one key per line
        (--api-keys-file; blank lines and lines starting with # are skipped)."""
        found = [k.strip() for k in (keys or "").split(",") if k.strip()]
        if keys_file:
            try:
                lines = Path(keys_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"cannot read the API keys file {keys_file!r}: {e}.") from None
            found += [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]
        return cls(tuple(found))

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check_header(self, value: str | None) -> bool:
        """Whether an `authorization` value carries one of the keys."""
        if not self.keys:
            return True
        if not value or value[: len(_BEARER)].lower() != _BEARER:
            return False
        given = value[len(_BEARER) :].strip().encode()
        # Every key is compared, so the time taken does not tell which one came close.
        return sum(hmac.compare_digest(given, k.encode()) for k in self.keys) > 0


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata presenting `key` (none when there is no key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def _metadata_value(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


MESSAGE = "a valid API key is required: send the metadata `authorization: Bearer <key>`."


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover - abort raises; this makes the function an async generator


class ApiKeyInterceptor(HandlerInterceptor):
    """UNAUTHENTICATED for calls without a valid key, before any handler runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    def replace(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_PREFIXES) or self.keys.check_header(
            _metadata_value(details, "authorization")
        ):
            return handler
        return with_behavior(handler, _deny_stream if handler.response_streaming else _deny_unary)
