"""Small protobuf values every Envoy resource builder needs (pure)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2, config_source_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message


def duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def ads_source() -> config_source_pb2.ConfigSource:
    """Resources that come over the same ADS stream (EDS, RDS, SDS)."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
    )


def packed(message: Message) -> any_pb2.Any:
    value = any_pb2.Any()
    value.Pack(message)
    return value


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header set to ``value``, replacing any copy already there."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
