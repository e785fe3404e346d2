"""OpenTelemetry tracing: one trace per request across router -> decode -> prefill -> KV transfer.

Off unless the standard OTEL_* variables name an exporter (`envs.otel_traces_exporters`). Off is
free: no TracerProvider exists, no gRPC interceptor is added, and `enabled()` is False, so services
skip every span (one boolean test per request, none per token).

On: the W3C trace context travels in gRPC metadata (opentelemetry-instrumentation-grpc, on the
calls that belong to a request) and in the KV target of a Prefill call. Milestones of the engine
thread are kept as timestamps and become spans afterwards on the event loop (`record_span`), so
the engine thread never calls into the SDK. The provider is ours, not the global one, so nothing
else in the process starts exporting by accident.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdmesh import __version__, envs
from pdmesh.logger import get_logger

log = get_logger(__name__)

# gRPC methods that belong to a request. The others (health checks, stats polls, reflection, the
# long-lived token streams) would each start a trace of their own several times a second.
TRACED_METHODS = (
    "/pdmesh.v1.Generation/Generate",
    "/pdmesh.v1.Generation/Tokenize",
    "/pdmesh.v1.DecodeWorker/Submit",
    "/pdmesh.v1.DecodeWorker/Abort",
    "/pdmesh.v1.DecodeWorker/Drain",
    "/pdmesh.v1.DecodeWorker/Migrate",
    "/pdmesh.v1.PrefillWorker/Prefill",
    "/pdmesh.v1.KVStore/Lookup",
    "/pdmesh.v1.KVStore/Put",
    "/pdmesh.v1.KVStore/Get",
)
_PROPAGATOR = TraceContextTextMapPropagator()


_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer: Tracer | None = None
_lock = threading.Lock()


def setup(service_name: str) -> bool:
    """Start exporting spans as OTEL_* asks; returns False, installing nothing, when tracing is off.

    service.name is `service_name` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one;
    the sampler (OTEL_TRACES_SAMPLER), batching (OTEL_BSP_*) and the exporter's endpoint, headers
    and TLS (OTEL_EXPORTER_OTLP_*) are read by the SDK itself. Idempotent."""
    global _provider, _tracer
    with _lock:
        if _provider is not None:
            return True
        exporters = envs.otel_traces_exporters()
        if not exporters:
            return False
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        provider = TracerProvider(resource=resource)
        for name in exporters:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
        _provider = provider
        _tracer = provider.get_tracer("pdmesh", __version__)
        log.info(
            "tracing on: service.name %s, exporters %s",
            resource.attributes.get(SERVICE_NAME),
            ", ".join(exporters),
        )
        return True


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if envs.otel_otlp_traces_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def shutdown() -> None:
    """Export what is buffered and stop; a no-op when tracing is off."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _provider is not None


# -- gRPC ---------------------------------------------------------------------------------------
def _traced(details: Any) -> bool:
    method = getattr(details, "method", "")
    if isinstance(method, bytes):  # grpc.aio client call details carry bytes (grpc#31092)
        method = method.decode()
    return method in TRACED_METHODS


def server_interceptors() -> list[Any]:
    """The server-side tracing interceptor, or nothing when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_traced)]


def client_interceptors() -> list[Any]:
    """Client-side tracing interceptors (inject the W3C context), or nothing when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(tracer_provider=_provider, filter_=_traced)


# -- context in messages ------------------------------------------------------------------------
def inject(span: Span | None = None) -> dict[str, str]:
    """The W3C trace context (traceparent, tracestate) of `span`, or of the current span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span) if span else None)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The context a carrier names, or None when it names none (or an invalid one)."""
    if not carrier:
        return None
    ctx = _PROPAGATOR.extract(dict(carrier))
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# -- spans --------------------------------------------------------------------------------------
def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def start_span(
    name: str,
    parent: Context | None = None,
    start_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """A span to end later (`end_span`); its parent is `parent`, else the current span. Call
    only when `enabled()`."""
    if _tracer is None:
        raise RuntimeError("tracing is off: check tracing.enabled() first")
    return _tracer.start_span(
        name, context=parent, start_time=start_ns, attributes=attributes, links=links
    )


def end_span(
    span: Span, end_ns: int | None = None, error: BaseException | str | None = None
) -> None:
    if isinstance(error, BaseException):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    elif error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    error: BaseException | str | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """A span that already happened, from its timestamps (unix ns)."""
    span = start_span(name, parent, start_ns, attributes, links)
    end_span(span, max(start_ns, end_ns), error)
    return span


@contextmanager
def use(span: Span | None) -> Iterator[None]:
    """Make `span` current inside the block (calls, tasks created there); None: no change."""
    if span is None:
        yield
        return
    # Errors are the caller's to report (with the status it chooses), not recorded twice here.
    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield
