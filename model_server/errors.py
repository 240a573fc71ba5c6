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
