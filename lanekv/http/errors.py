"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Every refusal of the front is an ``APIError``; the handlers turn it into the
JSON body, or into an SSE ``error`` event once a stream has begun. Messages
are one line and never carry a traceback.
"""

from __future__ import annotations

from typing import Any

import grpc

# The error type OpenAI's clients read, by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}

# The HTTP status of a decode daemon's gRPC status.
HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAUTHENTICATED: 502,  # the daemon refused the front's own token
    grpc.StatusCode.PERMISSION_DENIED: 502,
}


class APIError(Exception):
    """A refusal to send to the client: HTTP ``status``, a one-line ``message`` and
    the request field at fault (``param``), if one is."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        if status not in ERROR_TYPES:
            raise ValueError(f"status={status!r} is not an HTTP status the front answers with")
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES[self.status],
                          "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> APIError:
    """400 for request field ``param``; the message starts with the field's name."""
    return APIError(400, f"{param}: {message}", param=param)


def from_grpc(code: grpc.StatusCode, details: str, endpoint: str) -> APIError:
    """The client's error for a Generate call that ``endpoint`` ended with ``code``."""
    status = HTTP_OF_GRPC.get(code, 500)
    line = " ".join((details or "").split())[:1000]
    if status == 502:
        line = f"the decode daemon {endpoint} refused the front's credentials ({code.name}): {line}"
    elif status >= 500:
        line = f"decode daemon {endpoint}: {code.name}: {line}"
    return APIError(status, line, code=code.name.lower())
