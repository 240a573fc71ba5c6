"""Limits the public listener puts on every client, against slow and greedy ones.

Envoy's own protections, set explicitly (``listener.limits`` in the topology) rather than left
to defaults that change between releases:

- request headers: at most ``max_request_headers_kb`` in all and ``max_headers_count`` of them
  (HTTP/1.1: 431; HTTP/2: the stream is reset), so a header flood or oversized metadata costs a
  bounded amount;
- ``request_headers_timeout_s``: the headers of a request must arrive within it (slowloris:
  a connection that trickles its headers is closed);
- ``stream_idle_timeout_s``: a stream with no activity for this long is reset;
- ``max_stream_duration_s``: a unary request, body and answer included, may take this long at
  most (a body sent a byte a second is cut off); ModelStreamInfer routes are exempt, bounded by
  their idle timeout (the model's timeout between messages) instead;
- ``max_connection_duration_s``: a connection is drained (GOAWAY / ``Connection: close``) after
  this long, so no client holds one forever and load spreads after scale-ups;
- ``max_concurrent_streams``: HTTP/2 streams one connection may have open; more are refused;
- ``per_connection_buffer_limit_kb``: what Envoy reads from a connection before it stops
  reading (backpressure instead of memory);
- ``max_new_connections_per_s`` (off by default): connections the listener takes in a second
  (a token bucket, Envoy's network local_ratelimit filter, before any HTTP parsing); the ones
  over it are closed at once. It bounds connection churn, but the bucket is the listener's, not
  a client's: one client flooding connections then keeps new good clients out too (measured by
  bench/bench_hostile.py: at 1,000/s a header flood made good clients' new connections fail),
  so it is for deployments where a front load balancer spreads clients, or as a last resort.

The overload manager of the bootstrap (heap and connection caps) stays behind all of these.
"""

from __future__ import annotations

from typing import Any

from envoy.config.listener.v3 import listener_components_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.type.v3 import token_bucket_pb2

from control_plane.model.mesh import ListenerLimits
from control_plane.model.schema import Checker
from control_plane.xds.envoy_values import duration, packed

KINDS = {
    "max_request_headers_kb": "count", "max_headers_count": "count",
    "request_headers_timeout_s": "positive", "stream_idle_timeout_s": "positive",
    "max_stream_duration_s": "positive", "max_connection_duration_s": "positive",
    "max_concurrent_streams": "count", "per_connection_buffer_limit_kb": "count",
    "max_new_connections_per_s": "count",
}  # fmt: skip
# Envoy's own bounds: max_request_headers_kb is 1..8192, a header count and a stream count >= 1.
BOUNDS = {
    "max_request_headers_kb": (1, 8192), "max_headers_count": (1, 1 << 20),
    "max_concurrent_streams": (1, (1 << 31) - 1), "per_connection_buffer_limit_kb": (1, 1 << 22),
    "max_new_connections_per_s": (0, 1 << 20),
}  # fmt: skip


def apply(manager: hcm_pb2.HttpConnectionManager, limits: ListenerLimits) -> None:
    """The HTTP connection manager's side of the limits."""
    manager.max_request_headers_kb.value = limits.max_request_headers_kb
    options = manager.common_http_protocol_options
    options.max_headers_count.value = limits.max_headers_count
    options.max_stream_duration.CopyFrom(duration(limits.max_stream_duration_s))
    options.max_connection_duration.CopyFrom(duration(limits.max_connection_duration_s))
    manager.request_headers_timeout.CopyFrom(duration(limits.request_headers_timeout_s))
    manager.stream_idle_timeout.CopyFrom(duration(limits.stream_idle_timeout_s))
    manager.http2_protocol_options.max_concurrent_streams.value = limits.max_concurrent_streams


CONNECTION_LIMIT_FILTER = "envoy.filters.network.local_ratelimit"


def connection_filters(limits: ListenerLimits) -> list[listener_components_pb2.Filter]:
    """The network filters before the HTTP connection manager (none unless a rate is set)."""
    return [connection_rate_filter(limits)] if limits.max_new_connections_per_s else []


def connection_rate_filter(limits: ListenerLimits) -> listener_components_pb2.Filter:
    """The token bucket on new connections, first in the filter chain (refills every second,
    holds a second's worth)."""
    bucket = token_bucket_pb2.TokenBucket(
        max_tokens=limits.max_new_connections_per_s, fill_interval=duration(1.0)
    )
    bucket.tokens_per_fill.value = limits.max_new_connections_per_s
    config = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="edge_connections", token_bucket=bucket
    )
    return listener_components_pb2.Filter(name=CONNECTION_LIMIT_FILTER, typed_config=packed(config))


def buffer_limit_bytes(limits: ListenerLimits) -> int:
    return limits.per_connection_buffer_limit_kb * 1024


def exempt_stream(action: rc_pb2.RouteAction) -> None:
    """A streaming route: no overall duration (0 turns the connection manager's off)."""
    action.max_stream_duration.max_stream_duration.CopyFrom(duration(0))


def parse_limits(c: Checker, value: object, path: str) -> ListenerLimits:
    default = ListenerLimits()
    if value is None:
        return default
    m = c.mapping(value, path) or {}
    c.keys(m, path, KINDS)
    fields: dict[str, Any] = {
        key: c.value(m, path, key, kind, getattr(default, key)) for key, kind in KINDS.items()
    }
    for key, (low, high) in BOUNDS.items():
        if not low <= fields[key] <= high:
            c.fail(f"{path}.{key}", f"must be in {low}..{high}", fields[key])
            fields[key] = getattr(default, key)
    return ListenerLimits(**fields)
