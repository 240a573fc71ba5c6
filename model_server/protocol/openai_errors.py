"""The OpenAI API's errors: ``{"error": {message, type, param, code}}`` with the HTTP status.

``OpenAIError`` is an ``InferenceError`` (so the one request path counts it) with the HTTP
status, OpenAI's error ``type``, the ``param`` it is about and a ``code``; any other error of
the request path is answered in the same shape (``exception_document``).
"""

from __future__ import annotations

from typing import Any

import grpc

from model_server.core.errors import InferenceError, http_status

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return ERROR_TYPES.get(status, "invalid_request_error")


class OpenAIError(InferenceError):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(message, status)
        self.param = param
        self.error_code = code


def error_document(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def exception_document(exc: InferenceError) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for any error of the request path."""
    status = http_status(exc.code)
    if isinstance(exc, OpenAIError):
        return status, error_document(status, exc.message, exc.param, exc.error_code)
    return status, error_document(status, exc.message)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model {model!r} does not exist on this server (GET /v1/models lists them)",
        "model", "model_not_found", grpc.StatusCode.NOT_FOUND,
    )  # fmt: skip
