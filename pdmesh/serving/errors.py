"""The gRPC edge of `pdmesh.errors`: one interceptor maps exceptions to status codes.

A `PdmeshError` is answered with its `.status` and its message; a `TimeoutError` (an await
that ran out of time) with DEADLINE_EXCEEDED; anything else is a bug: INTERNAL with a message
that says nothing of it but an id, its traceback logged under that id, never dressed up as bad
input (bad input is caught where it is parsed, as an `InvalidRequest` naming the field).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from pdmesh.errors import FIELD_METADATA, InvalidRequest, as_error
from pdmesh.logger import get_logger

log = get_logger(__name__)

# Details travel in trailing metadata (8 KiB by default): a message that echoes a huge input
# must not become an error of its own.
MAX_DETAILS_CHARS = 1000
_HANDLER_KINDS = {  # (request streamed, response streamed) -> how grpc builds such a handler
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """Base of the interceptors that wrap or replace what a method does, per call: `replace`
    gets the method's handler and returns the one to run (`with_behavior` builds it)."""

    def replace(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return handler if handler is None else self.replace(handler, details)


def with_behavior(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` (same kind of method, same serializers) running `behavior` instead."""
    make = _HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
    return make(
        behavior,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def status_name(exc: BaseException) -> str:
    """The name of the gRPC status `exc` is answered with (for metrics; no logging)."""
    error = as_error(exc)
    return error.status if error is not None else "INTERNAL"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    error = as_error(exc)
    if error is None:
        incident = uuid.uuid4().hex[:12]
        log.error("internal error %s", incident, exc_info=exc)
        code = grpc.StatusCode.INTERNAL
        message = f"internal error {incident}: the server failed on this request (logged)."
    else:
        code = grpc.StatusCode[error.status]
        message = str(error) or code.name.lower().replace("_", " ")
    # Details must be UTF-8: a lone surrogate echoed from a request is written as its escape.
    message = message.encode("utf-8", "backslashreplace").decode()
    if len(message) > MAX_DETAILS_CHARS:
        message = message[: MAX_DETAILS_CHARS - 1] + "…"
    field = getattr(error, "field", None)  # so the next hop can name it too (HTTP's param)
    if field:  # metadata values are printable ASCII
        field = field.encode("unicode_escape").decode()[:MAX_DETAILS_CHARS]
    await context.abort(code, message, ((FIELD_METADATA, field),) if field else ())


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def parse(raw: bytes) -> Any:
        """The message, or (grpc would answer a deserializer's exception INTERNAL) the
        InvalidRequest its handler raises."""
        try:
            return deserialize(raw)
        except Exception as e:
            field = bad_utf8_field(message_type, raw) if message_type is not None else None
            error = f"{field} is not valid UTF-8 text" if field else f"{type(e).__name__}: {e}"
            return InvalidRequest(
                f"the request is not a valid message for this method ({error}).", field
            )

    return parse


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path ("chat.messages.content") of the first string field of a `descriptor` message
    on the wire whose bytes are not UTF-8 (protobuf refuses the whole message without saying
    which); None if there is none or `data` is no message at all."""
    # Parsed as a message with no fields, every field is kept as raw unknown-field bytes.
    holder = empty_pb2.Empty()
    try:
        holder.ParseFromString(data)
    except DecodeError:
        return None
    for raw in UnknownFieldSet(holder):
        field = descriptor.fields_by_number.get(raw.field_number)
        if field is None or not isinstance(raw.data, bytes):
            continue
        name = prefix + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                raw.data.decode()
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = bad_utf8_field(field.message_type, raw.data, name + ".")
            if found is not None:
                return found
    return None


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if request.__class__ is InvalidRequest:
                raise request
            return await fn(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if request.__class__ is InvalidRequest:
                raise request
            async for item in fn(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return handler


class ErrorInterceptor(HandlerInterceptor):
    """Wraps handlers of single-message requests (parsed tolerantly, so a malformed one is
    INVALID_ARGUMENT); streamed-request handlers pass through."""

    def replace(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.request_streaming:
            return handler
        if handler.response_streaming:
            behavior = _wrap_stream(handler.unary_stream)
        else:
            behavior = _wrap_unary(handler.unary_unary)
        return with_behavior(handler, behavior, _tolerant(handler.request_deserializer))
