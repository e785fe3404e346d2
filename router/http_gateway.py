"""OpenAI-compatible HTTP gateway on the router (aiohttp): completions, chat completions (SSE
streaming), models, health and Prometheus metrics; HTTPS with the router's certificate when TLS is
configured, and API keys (`Authorization: Bearer <key>`, else 401) on everything but `/health`
and `/metrics`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: a `pdmesh.errors`
class answers with its `http_status` (bad input 400 naming the field; a body that cannot be read
400, 413 or 415, router/http_body.py; 429 with Retry-After, 503, 504); an unexpected exception is
a bug: 500 with an incident id, logged with its traceback under it. A client
that disconnects cancels its handler (handler_cancellation), which closes the router's generator,
which aborts the request on its decode worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from functools import partial
from typing import Any

from aiohttp import web

from pdmesh.errors import as_error
from pdmesh.logger import get_logger
from pdmesh.observability.metrics_server import split_host_port
from pdmesh.router import metrics
from pdmesh.router.core import Router
from pdmesh.router.http_body import MAX_BODY_BYTES, read_json
from pdmesh.router.openai_answer import Answer
from pdmesh.router.openai_logprobs import TokenTexts
from pdmesh.router.openai_protocol import OpenAIRequest, parse
from pdmesh.router.openai_responses import (
    ChunkWriter,
    ResponseHead,
    error_body,
    model_card,
    models_body,
)
from pdmesh.router.tool_parsers.registry import pick_parser
from pdmesh.serving.auth import ApiKeys
from pdmesh.v1.generation_pb2 import GenerateResponse as Chunk

log = get_logger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers need no key
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CLIENT_CLOSED = "499"  # nginx's code for "the client went away first"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must pass each event on at once
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    headers = {"Retry-After": "1"} if status == 429 else None
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


def status_of(exc: Exception) -> tuple[int, str, str | None]:
    """(HTTP status, message, param) for an exception raised while serving a request. Bad input
    is caught where it is parsed, as a `pdmesh.errors` class; anything else is a bug: 500 with a
    message that says nothing of it but an id, and the traceback logged under that id."""
    error = as_error(exc)
    if error is not None:
        return error.http_status, str(error), getattr(error, "field", None)
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s in the HTTP gateway", incident, exc_info=exc)
    return 500, f"internal error {incident}: the server failed on this request (logged).", None


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413) in OpenAI's error body."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        metrics.count_request("other", str(e.status))
        return error_response(e.status, f"{e.reason}: {request.method} {request.path}")


def require_api_key(keys: ApiKeys) -> Any:
    """A middleware answering 401 (OpenAI's body, code invalid_api_key) without a valid key."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or keys.check_header(request.headers.get("Authorization")):
            return await handler(request)
        metrics.count_request("other", "401")
        return web.json_response(
            error_body(
                401,
                "a valid API key is required: send the header `Authorization: Bearer <key>`.",
                code="invalid_api_key",
            ),
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    return check


class Gateway:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())
        # The model's tool-call format, for tool_choice "auto".
        tokenizer = router.validator.tokenizer
        self.tool_format = pick_parser(router.config.tool_call_parser, tokenizer.chat_template)
        self.token_texts = TokenTexts(tokenizer.decode)

    async def generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """/v1/completions and /v1/chat/completions."""
        record = metrics.RequestRecorder(endpoint)
        req: OpenAIRequest | None = None
        try:
            body = await read_json(request)
            req = parse(body, chat=endpoint == CHAT)
            tools = req.tools
            if tools is not None:  # refused before any work when the model's format is unknown
                tools.parser(self.tool_format)
            inp = await self.router.validator.validate(
                req.spec, "chatcmpl-" if req.chat else "cmpl-"
            )
            record.prompt(len(inp.prompt))
            head = ResponseHead(inp.request_id, int(time.time()), self.router.model_name, req.chat)
            echo_text = ""
            if req.echo:  # the prompt as given; token ids as their text
                echo_text = req.spec.prompt.text
                if echo_text is None:
                    echo_text = self.router.validator.tokenizer.decode(inp.prompt)
            answer = Answer(
                req,
                inp.prompt,
                echo_text,
                self.token_texts,
                # What reads tool calls out of each choice (None: no tools, or "none").
                lambda: tools.parser(self.tool_format) if tools is not None else None,
            )
            async with aclosing(self.router.generate(inp)) as chunks:
                # The first chunk comes before any header, so errors that happen before the
                # first token (no worker, a refused submit) are still proper HTTP statuses.
                first = await anext(chunks)
                if req.stream:
                    return await _stream(request, req, head, first, chunks, record, answer)
                async for chunk in _through_last(first, chunks, record):
                    answer.add(chunk)
                record.done("200")
                return web.json_response(answer.body(head, chunk.usage))
        except asyncio.CancelledError:
            record.done(CLIENT_CLOSED)
            raise
        except Exception as exc:
            if req is not None and req.tools is not None:
                exc = req.tools.refusal(exc)
            status, message, param = status_of(exc)
            record.done(str(status))
            return error_response(status, message, param)

    async def models(self, request: web.Request) -> web.Response:
        r = self.router
        metrics.count_request("/v1/models", "200")
        return web.json_response(models_body(r.model_name, self.created, r.max_model_len))

    async def model(self, request: web.Request) -> web.Response:
        r = self.router
        name = request.match_info["model"]
        if name != r.model_name:
            metrics.count_request("/v1/models", "404")
            return error_response(
                404, f"model {name!r} does not exist; this mesh serves {r.model_name!r}.", "model"
            )
        metrics.count_request("/v1/models", "200")
        return web.json_response(model_card(r.model_name, self.created, r.max_model_len))

    async def health(self, request: web.Request) -> web.Response:
        r = self.router
        decode = len(r.registry.healthy("decode"))
        body = {
            "status": "ok" if decode else "unavailable",
            "model": r.model_name,
            "decode_workers": decode,
            "prefill_workers": len(r.registry.healthy("prefill")),
        }
        return web.json_response(body, status=200 if decode else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})


async def _through_last(
    first: Chunk, chunks: AsyncIterator[Chunk], record: metrics.RequestRecorder
) -> AsyncIterator[Chunk]:
    """`first`, then the rest of `chunks` up to the request's last (the one with its usage;
    with n > 1 each choice's finish reason comes before it), counted."""
    chunk = first
    while True:
        record.tokens(len(chunk.token_ids))
        yield chunk
        if chunk.HasField("usage"):
            return
        chunk = await anext(chunks)


async def _stream(
    request: web.Request,
    req: OpenAIRequest,
    head: ResponseHead,
    first: Chunk,
    chunks: AsyncIterator[Chunk],
    record: metrics.RequestRecorder,
    answer: Answer,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    writer = ChunkWriter(head, req.include_usage)
    status = "200"
    try:
        async for chunk in _through_last(first, chunks, record):
            events = answer.events(chunk, writer)
            if req.include_usage and chunk.HasField("usage"):  # the request's last chunk
                events.append(writer.usage(chunk.usage))
            if events:  # one write, one send: a chat's first chunk is two events, its last two
                await response.write(b"".join(events))
    except ConnectionResetError:
        # The client left; leaving this function closes the generator, which aborts.
        record.done(CLIENT_CLOSED)
        return response
    except Exception as exc:  # the headers are sent: the error goes out as an event
        code, message, _ = status_of(exc)
        status = str(code)
        await _write_quietly(response, ChunkWriter.error(code, message))
    await _write_quietly(response, ChunkWriter.DONE)
    record.done(status)
    return response


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with suppress(ConnectionResetError):
        await response.write(data)


async def start_gateway(router: Router) -> web.AppRunner:
    """Serve the gateway on the router's `http_bind`, over HTTPS and with API keys when its
    config says so; stop it with `await runner.cleanup()`."""
    config = router.config
    host, port = split_host_port(config.http_bind or "", "HTTP bind address")
    gateway = Gateway(router)
    middlewares: list[Any] = [openai_errors]
    if config.api_keys.required:
        middlewares.insert(0, require_api_key(config.api_keys))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app.router.add_post(COMPLETIONS, partial(gateway.generate, endpoint=COMPLETIONS))
    app.router.add_post(CHAT, partial(gateway.generate, endpoint=CHAT))
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/models/{model}", gateway.model)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics)
    # handler_cancellation: a client that disconnects cancels its handler, so its request is
    # aborted on the workers instead of running to the end for nobody.
    # auto_decompress off: the body's coding is undone by http_body.read_json, within limits.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False)
    await runner.setup()
    tls = config.tls
    ssl_context = tls.ssl_server_context(config.public_client_auth) if tls is not None else None
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    scheme = "https" if ssl_context is not None else "http"
    log.info("OpenAI-compatible HTTP gateway on %s://%s:%d/v1", scheme, host, port)
    return runner
