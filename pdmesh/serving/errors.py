"""The gRPC edge of `pdmesh.errors`: one interceptor maps exceptions to status codes.

A `PdmeshError` is answered with its `.status` and its message; a `TimeoutError` (an await
that ran out of time) with DEADLINE_EXCEEDED; anything else is a bug: INTERNAL, logged with its
traceback, never dressed up as bad input.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from pdmesh.errors import PdmeshError
from pdmesh.logger import get_logger

log = get_logger(__name__)


def status_name(exc: BaseException) -> str:
    """The name of the gRPC status `exc` is answered with (for metrics; no logging)."""
    if isinstance(exc, PdmeshError):
        return exc.status
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED.name
    return grpc.StatusCode.INTERNAL.name


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an exception that reached the edge; an unexpected one is logged
    with its traceback."""
    code = grpc.StatusCode[status_name(exc)]
    if isinstance(exc, PdmeshError | TimeoutError):
        return code, str(exc) or code.name.lower().replace("_", " ")
    log.error("internal error", exc_info=exc)
    return code, f"internal error: {type(exc).__name__}: {exc}"


# Details travel in trailing metadata (8 KiB by default): a message that echoes a huge input
# must not become an error of its own.
MAX_DETAILS_CHARS = 1000


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    # Details must be UTF-8: a lone surrogate echoed from a request is written as its escape.
    message = message.encode("utf-8", "backslashreplace").decode()
    if len(message) > MAX_DETAILS_CHARS:
        message = message[: MAX_DETAILS_CHARS - 1] + "…"
    await context.abort(code, message)


class MalformedRequest:
    """What a request that is not a valid message of its method deserializes to: grpc would
    answer INTERNAL for a deserializer's exception; the handler answers INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:
            field = bad_utf8_field(message_type, raw) if message_type is not None else None
            if field is not None:
                return MalformedRequest(f"{field} is not valid UTF-8 text")
            return MalformedRequest(f"{type(e).__name__}: {e}")

    return parse


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path ("chat.messages.content") of the first string field of a `descriptor` message
    on the wire whose bytes are not UTF-8 (protobuf refuses the whole message without saying
    which); None if there is none or `data` is no message at all."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type != _LENGTH_DELIMITED:
                pos = _skip(data, pos, wire_type)
                continue
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode()
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_utf8_field(field.message_type, value, name + ".")
                if found is not None:
                    return found
    except IndexError:
        return None
    return None


_LENGTH_DELIMITED = 2


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    """The position after a field that is not length-delimited (IndexError: not a message)."""
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type in (1, 5):
        return pos + (8 if wire_type == 1 else 4)
    raise IndexError(f"wire type {wire_type}")


async def _refuse_malformed(request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid message for this method ({request.error}).",
    )


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.__class__ is MalformedRequest:
            await _refuse_malformed(request, context)
        try:
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if request.__class__ is MalformedRequest:
            await _refuse_malformed(request, context)
        try:
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers (their requests are parsed tolerantly, so a
    malformed one is INVALID_ARGUMENT); others pass through."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler
