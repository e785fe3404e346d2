"""One interceptor maps exceptions to gRPC status codes, with a sentence for the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pdmesh.logger import get_logger

log = get_logger(__name__)


class ServiceError(Exception):
    """An error with a chosen status code (RESOURCE_EXHAUSTED, UNAVAILABLE, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND, f"not found: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


# Details travel in trailing metadata (8 KiB by default): a message that echoes a huge input
# must not become an error of its own.
MAX_DETAILS_CHARS = 1000


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    if len(message) > MAX_DETAILS_CHARS:
        message = message[: MAX_DETAILS_CHARS - 1] + "…"
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
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

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:
            return MalformedRequest(f"{type(e).__name__}: {e}")

    return parse


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
