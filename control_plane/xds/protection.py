"""Mesh protection in Envoy: per-model rate limits, circuit breakers and fallback clusters.

- **Rate limit**: Envoy's local rate limit filter sits in the listener with no bucket of its
  own; each route of a model with ``rate_limit`` carries a token bucket. A request over the
  limit gets a trailers-only gRPC RESOURCE_EXHAUSTED at once, with ``retry-after`` (seconds)
  and ``x-infermesh-rate-limited: MODEL`` in its headers. Each route has its own bucket (the
  model's route and each of its version routes).
- **Circuit breakers**: a model's clusters get its ``max_requests`` and
  ``max_pending_requests``; past them Envoy answers UNAVAILABLE without queueing.
- **Fallback**: a model with a fallback is routed to an aggregate cluster, its own cluster
  first and the fallback model's after. Envoy uses the second only when the first has no
  healthy endpoint (the first cluster's overprovisioning factor is raised so a partly ejected
  pool does not spill). The route adds ``x-infermesh-fallback: FALLBACK`` to each request; a
  model server without the requested model serves the fallback instead and says so in the
  response (``model_name`` and the parameter ``infermesh_fallback_from``).
"""

from __future__ import annotations

import math

from envoy.config.cluster.v3 import circuit_breaker_pb2 as cb_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import any_pb2
from google.protobuf.wrappers_pb2 import UInt32Value

from control_plane.model.mesh import CircuitBreaker, RateLimit
from control_plane.xds.envoy_values import duration, packed, set_header
from infermesh.wire import RATE_LIMITED_HEADER

RATE_LIMIT_FILTER = "envoy.filters.http.local_ratelimit"
AGGREGATE_CLUSTER = "envoy.clusters.aggregate"
MIN_FILL_INTERVAL_S = 0.05  # Envoy's lower bound for a token bucket's fill interval
# A cluster that has a fallback keeps all its traffic while any endpoint is healthy.
NO_SPILL_OVERPROVISIONING = 100_000
UNLIMITED = 1_000_000  # effectively no limit: the retry budget bounds retries


def percent_of(value: float) -> base_pb2.RuntimeFractionalPercent:
    return base_pb2.RuntimeFractionalPercent(
        default_value=percent_pb2.FractionalPercent(
            numerator=int(value), denominator=percent_pb2.FractionalPercent.HUNDRED
        ),
        runtime_key="",
    )


def rate_limit_filter() -> hcm_pb2.HttpFilter:
    """The listener's filter: no bucket of its own, so only routes that carry one are limited."""
    config = local_rate_limit_pb2.LocalRateLimit(stat_prefix="model_rate_limit")
    return hcm_pb2.HttpFilter(name=RATE_LIMIT_FILTER, typed_config=packed(config))


def token_bucket(limit: RateLimit) -> token_bucket_pb2.TokenBucket:
    """``requests_per_s`` as whole tokens per fill interval (Envoy needs >= 50 ms)."""
    interval = max(MIN_FILL_INTERVAL_S, 1.0 / limit.requests_per_s)
    tokens = max(1, round(limit.requests_per_s * interval))
    return token_bucket_pb2.TokenBucket(
        max_tokens=limit.burst,
        tokens_per_fill=UInt32Value(value=tokens),
        fill_interval=duration(interval),
    )


def retry_after_s(bucket: token_bucket_pb2.TokenBucket) -> int:
    """Whole seconds until ``bucket`` has a token again (at least 1): its fill interval."""
    return max(1, math.ceil(bucket.fill_interval.ToTimedelta().total_seconds()))


def enforced_bucket(
    stat_prefix: str, bucket: token_bucket_pb2.TokenBucket, retry_after_s: int, limited_by: str
) -> local_rate_limit_pb2.LocalRateLimit:
    """A local rate limit that refuses with RESOURCE_EXHAUSTED / 429, ``retry-after`` and
    ``x-infermesh-rate-limited: limited_by`` (the model, or "tenant")."""
    headers = [
        set_header("retry-after", str(retry_after_s)),
        set_header(RATE_LIMITED_HEADER, limited_by),
    ]
    return local_rate_limit_pb2.LocalRateLimit(
        stat_prefix=stat_prefix,
        token_bucket=bucket,
        filter_enabled=percent_of(100),
        filter_enforced=percent_of(100),
        response_headers_to_add=headers,
        rate_limited_as_resource_exhausted=True,
    )


def route_rate_limit(model: str, limit: RateLimit) -> any_pb2.Any:
    """The per-route configuration of the rate limit filter for one model's route."""
    bucket = token_bucket(limit)
    return packed(enforced_bucket("model_rate_limit", bucket, retry_after_s(bucket), model))


def circuit_breakers(
    budget_percent: float, breaker: CircuitBreaker | None = None
) -> cb_pb2.CircuitBreakers:
    """The model's limits (unlimited without ``breaker``), and the retry budget.

    Envoy's default allows 3 concurrent retries per cluster, which overflows under load: a
    budget (a share of the active requests) bounds retries instead.
    """
    breaker = breaker or CircuitBreaker(UNLIMITED, UNLIMITED)
    budget = cb_pb2.CircuitBreakers.Thresholds.RetryBudget(
        budget_percent=percent_pb2.Percent(value=budget_percent),
        min_retry_concurrency=UInt32Value(value=10),
    )
    thresholds = cb_pb2.CircuitBreakers.Thresholds(
        max_connections=UInt32Value(value=UNLIMITED),
        max_pending_requests=UInt32Value(value=breaker.max_pending_requests),
        max_requests=UInt32Value(value=breaker.max_requests),
        retry_budget=budget,
    )
    return cb_pb2.CircuitBreakers(thresholds=[thresholds])


def aggregate_cluster(
    name: str, clusters: list[str], retry_budget_percent: float
) -> cluster_pb2.Cluster:
    """A cluster that tries ``clusters`` in order, each only when those before have no
    healthy endpoint. Its retry budget is the model's: Envoy applies an aggregate cluster's
    own retry limit to retries routed through it (envoyproxy/envoy#17412, #38251), where the
    default would allow 3 concurrent retries; its other limits are the clusters' behind it."""
    config = packed(aggregate_pb2.ClusterConfig(clusters=clusters))
    return cluster_pb2.Cluster(
        name=name,
        connect_timeout=duration(1.0),
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        cluster_type=cluster_pb2.Cluster.CustomClusterType(
            name=AGGREGATE_CLUSTER, typed_config=config
        ),
        circuit_breakers=circuit_breakers(retry_budget_percent),
    )
