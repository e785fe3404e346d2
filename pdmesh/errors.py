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

import re
from typing import Any, ClassVar

_BY_STATUS: dict[str, type[PdmeshError]] = {}


class PdmeshError(Exception):
    """Base of every error meant for the caller; the message is a sentence they can act on.
    A subclass names its codes once: `class NotFound(PdmeshError, status="NOT_FOUND",
    http_status=404)`."""

    status: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500

    def __init_subclass__(cls, status: str = "", http_status: int = 0, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if status:
            cls.status, cls.http_status = status, http_status
            _BY_STATUS[status] = cls


class InvalidRequest(PdmeshError, ValueError, status="INVALID_ARGUMENT", http_status=400):
    """The request is wrong; `field` names the part of it (a ValueError for offline callers)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotFound(PdmeshError, status="NOT_FOUND", http_status=404):
    """What the request names does not exist (a model, a request id)."""


class Overloaded(PdmeshError, status="RESOURCE_EXHAUSTED", http_status=429):
    """Too much work right now (queue full, no blocks): retry later."""


class Unavailable(PdmeshError, status="UNAVAILABLE", http_status=503):
    """A worker or a hop is down, or this service cannot take the request now."""


class FailedPrecondition(PdmeshError, status="FAILED_PRECONDITION", http_status=400):
    """The service is in a state that refuses this request (draining, wrong role, ...)."""


class DeadlineExceeded(PdmeshError, status="DEADLINE_EXCEEDED", http_status=504):
    """The request's deadline passed before it finished."""


class Cancelled(PdmeshError, status="CANCELLED", http_status=499):
    """The client went away or cancelled."""


class Unauthenticated(PdmeshError, status="UNAUTHENTICATED", http_status=401):
    """No valid API key or client certificate."""


# A native library's messages (xgrammar's) start with a time and a C++ source location, and its
# checks name the expression that failed: "[01:53:18] /project/cpp/x.cc:49: Check failed: (a)
# is false: msg". Callers need the msg only.
_SOURCE_LOCATION = re.compile(
    r"\[\d{2}:\d{2}:\d{2}\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*"
)


def without_source_locations(message: str) -> str:
    """`message` without a native library's source locations, on one line."""
    return " ".join(_SOURCE_LOCATION.sub("", message).split())


def from_status(status: str, message: str, field: str | None = None) -> PdmeshError:
    """The error a remote hop reported by status name (an unknown name is INTERNAL), with the
    field it named for bad input (the FIELD_METADATA trailer). Source locations a native library
    put in the message are dropped here too: a client never sees them."""
    cls = _BY_STATUS.get(status, PdmeshError)
    message = without_source_locations(message) or status
    return InvalidRequest(message, field) if cls is InvalidRequest else cls(message)


# The trailing-metadata key that carries an InvalidRequest's field between services.
FIELD_METADATA = "pdmesh-field"


def as_error(exc: BaseException) -> PdmeshError | None:
    """What an edge answers for `exc`: itself, or DeadlineExceeded for a TimeoutError (an await
    that ran out of time); None for anything else, a bug (INTERNAL / 500, with its traceback)."""
    if isinstance(exc, PdmeshError):
        return exc
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded(str(exc) or "deadline exceeded")
    return None
