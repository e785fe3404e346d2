"""The errors a caller of pdmesh is meant to see, as one small hierarchy.

Domain code (engine, services, router) raises these and nothing transport-specific: the gRPC
edge (`pdmesh.serving.errors`) and the HTTP gateway map them to a status code and an HTTP code,
and only there. Any other exception reaching an edge is a bug: it is answered INTERNAL / 500 and
logged with its traceback, never dressed up as bad input.

`status` is the name of the gRPC status code (`grpc.StatusCode[status]` at the edge), so this
module needs neither grpc nor torch; across a hop (a decode worker's error relayed by the router)
the name travels and `from_status` rebuilds the error.
"""

from __future__ import annotations

from typing import ClassVar


class PdmeshError(Exception):
    """Base of every error meant for the caller; the message is a sentence they can act on."""

    status: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500


class InvalidRequest(PdmeshError, ValueError):
    """The request is wrong; `field` names the part of it (a ValueError for offline callers)."""

    status = "INVALID_ARGUMENT"
    http_status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotFound(PdmeshError):
    status = "NOT_FOUND"
    http_status = 404


class Overloaded(PdmeshError):
    """Too much work right now (queue full, no blocks): retry later."""

    status = "RESOURCE_EXHAUSTED"
    http_status = 429


class Unavailable(PdmeshError):
    """A worker or a hop is down, or this service cannot take the request now."""

    status = "UNAVAILABLE"
    http_status = 503


class FailedPrecondition(PdmeshError):
    """The service is in a state that refuses this request (draining, wrong role, ...)."""

    status = "FAILED_PRECONDITION"
    http_status = 400


class DeadlineExceeded(PdmeshError):
    status = "DEADLINE_EXCEEDED"
    http_status = 504


class Cancelled(PdmeshError):
    status = "CANCELLED"
    http_status = 499


class Unauthenticated(PdmeshError):
    status = "UNAUTHENTICATED"
    http_status = 401


_BY_STATUS: dict[str, type[PdmeshError]] = {
    cls.status: cls
    for cls in (
        PdmeshError,
        InvalidRequest,
        NotFound,
        Overloaded,
        Unavailable,
        FailedPrecondition,
        DeadlineExceeded,
        Cancelled,
        Unauthenticated,
    )
}


def from_status(status: str, message: str) -> PdmeshError:
    """The error a remote hop reported by status name (an unknown name is INTERNAL)."""
    return _BY_STATUS.get(status, PdmeshError)(message)
