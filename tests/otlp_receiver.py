"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[str, ...] = ()  # span ids
    error: bool = False


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for scope in rs.scope_spans:
                for s in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple(link.span_id.hex() for link in s.links),
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            time.sleep(0.1)
        return self.trace(trace_id)

    def stop(self) -> None:
        self._server.stop(grace=None)
