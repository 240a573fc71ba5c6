"""Errors that carry the gRPC status a client should see."""

from __future__ import annotations

import grpc


class InferenceError(Exception):
    """An error answered to the client with ``code`` and a message naming what was wrong."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidInput(InferenceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(InferenceError):
    code = grpc.StatusCode.NOT_FOUND


class ModelUnavailable(InferenceError):
    code = grpc.StatusCode.UNAVAILABLE


class ModelConfigError(Exception):
    """A model's configuration is invalid; the model goes FAILED with this reason."""


class MemoryBudgetExceeded(Exception):
    """Loading a model would cross the memory budget."""


# The HTTP status a REST client sees for each gRPC status (KServe v2 REST, Triton's choices).
# One table for every HTTP face of the mesh: the model server's REST port, and the control
# plane / Envoy when they answer REST clients. Anything missing here is a 500.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # nginx's "client closed request"
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 for those without a closer match)."""
    return HTTP_STATUS.get(code, 500)
