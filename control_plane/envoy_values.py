"""Small protobuf values every Envoy resource builder needs (pure)."""

from __future__ import annotations

from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message


def duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def packed(message: Message) -> any_pb2.Any:
    value = any_pb2.Any()
    value.Pack(message)
    return value
