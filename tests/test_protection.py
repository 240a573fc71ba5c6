"""Mesh protection as Envoy resources: rate limits, circuit breakers, fallback aggregates."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from control_plane import bootstrap
from control_plane.mesh import (
    ROUTE_CONFIG_NAME,
    CircuitBreaker,
    EndpointAddress,
    EndpointAssignment,
    ListenerOptions,
    MeshState,
    ModelRoute,
    RateLimit,
    fallback_cluster,
    model_cluster,
)
from control_plane.protection import FALLBACK_HEADER, RATE_LIMIT_FILTER, token_bucket
from control_plane.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    build_resources,
)
from control_plane.snapshot import build_snapshot
from control_plane.topology import TopologyError, parse_topology

A = EndpointAssignment(EndpointAddress("127.0.0.1", 9001))
B = EndpointAssignment(EndpointAddress("127.0.0.1", 9002))
BIG, SMALL = model_cluster("classifier"), model_cluster("classifier-small")
Resources = dict[str, dict[str, Any]]


def protected_state(**classifier: Any) -> MeshState:
    big = ModelRoute(
        "classifier", 50, 2.0,
        rate_limit=RateLimit(500, 100),
        circuit_breaker=CircuitBreaker(max_requests=64, max_pending_requests=8),
        fallback="classifier-small",
        **classifier,
    )  # fmt: skip
    clusters = {BIG: (A,), SMALL: (B,), model_cluster("classifier", "1"): (A,)}
    return MeshState(ListenerOptions(), (big, ModelRoute("classifier-small", 20, 1.0)), clusters)


@pytest.mark.parametrize(
    ("requests_per_s", "tokens", "interval_s"),
    [(500, 25, 0.05), (20, 1, 0.05), (7, 1, 1 / 7), (0.5, 1, 2.0), (1000, 50, 0.05)],
)
def test_token_bucket_keeps_the_rate(requests_per_s: float, tokens: int, interval_s: float) -> None:
    bucket = token_bucket(RateLimit(requests_per_s, 10))
    interval = bucket.fill_interval.ToTimedelta().total_seconds()
    assert bucket.tokens_per_fill.value == tokens and interval == pytest.approx(interval_s)
    assert bucket.max_tokens == 10
    assert tokens / interval == pytest.approx(requests_per_s, rel=0.25)


def test_rate_limited_routes_and_the_filter_order() -> None:
    resources: Resources = build_resources(protected_state())
    (listener,) = resources[LISTENER_TYPE].values()
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    names = [f.name for f in manager.http_filters]
    assert names == ["envoy.filters.http.lua", RATE_LIMIT_FILTER, "envoy.filters.http.router"]
    routes = {r.name: r for r in resources[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes}
    for name in (BIG, model_cluster("classifier", "1")):
        limit = local_rate_limit_pb2.LocalRateLimit()
        assert routes[name].typed_per_filter_config[RATE_LIMIT_FILTER].Unpack(limit)
        assert limit.token_bucket.max_tokens == 100 and limit.rate_limited_as_resource_exhausted
        assert limit.filter_enforced.default_value.numerator == 100
        headers = {h.header.key: h.header.value for h in limit.response_headers_to_add}
        assert headers == {"retry-after": "1", "x-infermesh-rate-limited": "classifier"}
    assert RATE_LIMIT_FILTER not in routes[SMALL].typed_per_filter_config


def test_no_rate_limit_no_filter() -> None:
    state = MeshState(ListenerOptions(), (ModelRoute("m", 50, 1.0),), {model_cluster("m"): (A,)})
    listener: Any
    (listener,) = build_resources(state)[LISTENER_TYPE].values()
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert RATE_LIMIT_FILTER not in [f.name for f in manager.http_filters]


def test_circuit_breakers_per_model() -> None:
    clusters: dict[str, Any] = build_resources(protected_state())[CLUSTER_TYPE]
    (limits,) = clusters[BIG].circuit_breakers.thresholds
    assert (limits.max_requests.value, limits.max_pending_requests.value) == (64, 8)
    assert limits.retry_budget.budget_percent.value == 25
    (small,) = clusters[SMALL].circuit_breakers.thresholds
    assert small.max_requests.value >= 100_000


def test_fallback_goes_through_an_aggregate_and_names_the_fallback() -> None:
    resources: Resources = build_resources(protected_state())
    routes = {r.name: r for r in resources[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes}
    assert routes[BIG].route.cluster == fallback_cluster(BIG)
    (header,) = routes[BIG].request_headers_to_add
    assert (header.header.key, header.header.value) == (FALLBACK_HEADER, "classifier-small")
    aggregate = resources[CLUSTER_TYPE][fallback_cluster(BIG)]
    config = aggregate_pb2.ClusterConfig()
    assert aggregate.cluster_type.typed_config.Unpack(config)
    assert list(config.clusters) == [BIG, SMALL]
    assert fallback_cluster(BIG) not in resources[ENDPOINT_TYPE]  # no EDS of its own
    # The primary keeps all its traffic while any endpoint is healthy; others are untouched.
    assert resources[ENDPOINT_TYPE][BIG].policy.overprovisioning_factor.value >= 10_000
    assert not resources[ENDPOINT_TYPE][SMALL].policy.HasField("overprovisioning_factor")
    assert routes[SMALL].route.cluster == SMALL
    build_snapshot(resources)  # consistent: every EDS name a cluster's


def test_fallback_with_a_version_split() -> None:
    resources: Resources = build_resources(protected_state(version_split=(("1", 100),)))
    routes = {r.name: r for r in resources[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes}
    (weighted,) = routes[BIG].route.weighted_clusters.clusters
    assert weighted.name == fallback_cluster(model_cluster("classifier", "1"))
    assert fallback_cluster(model_cluster("classifier", "1")) in resources[CLUSTER_TYPE]
    build_snapshot(resources)


MODEL = {"name": "a", "sla_p99_ms": 50, "capacity_qps": 10}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"rate_limit": {"burst": 5}}, "models[0].rate_limit.requests_per_s: required"),
        (
            {"rate_limit": {"requests_per_s": -1}},
            "models[0].rate_limit.requests_per_s: must be > 0",
        ),
        (
            {"rate_limit": {"requests_per_s": 5, "burst": 0}},
            "models[0].rate_limit.burst: must be >= 1",
        ),
        ({"rate_limit": 5}, "models[0].rate_limit: must be a mapping"),
        ({"circuit_breaker": {"max_requests": 0}}, "models[0].circuit_breaker.max_requests: must"),
        ({"circuit_breaker": {"max_pending": 3}}, "models[0].circuit_breaker.max_pending: unknown"),
        ({"fallback": "a"}, "models[0].fallback: a model cannot be its own fallback"),
        ({"fallback": "zz"}, 'models[0].fallback: "zz" is not a model of the topology'),
        ({"fallback": 3}, "models[0].fallback: must be a string"),
    ],
)
def test_protection_errors_are_named(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(TopologyError) as raised:
        parse_topology({"models": [{**MODEL, **fields}]})
    assert any(e.startswith(error) for e in raised.value.errors), raised.value.errors


def test_protection_from_the_topology() -> None:
    topology = parse_topology(
        {
            "models": [
                {**MODEL, "rate_limit": {"requests_per_s": 2.5}, "fallback": "b",
                 "circuit_breaker": {"max_requests": 10}},
                {**MODEL, "name": "b"},
            ]
        }
    )  # fmt: skip
    a = topology.models[0]
    assert a.rate_limit == RateLimit(2.5, 3)  # the default burst: one second's worth
    assert a.circuit_breaker == CircuitBreaker(max_requests=10)
    assert a.fallback == "b"
    with pytest.raises(TopologyError, match="has a fallback of its own"):
        parse_topology(
            {"models": [{**MODEL, "fallback": "b"}, {**MODEL, "name": "b", "fallback": "a"}]}
        )


def test_bootstrap_overload_manager_sheds_on_heap_and_connections() -> None:
    config = bootstrap.render_bootstrap(
        node_id="e", node_cluster="c", xds_host="127.0.0.1", xds_port=1, admin_port=2, delta=False
    )
    overload = config["overload_manager"]
    monitors = [m["name"] for m in overload["resource_monitors"]]
    assert monitors == [
        "envoy.resource_monitors.fixed_heap",
        "envoy.resource_monitors.global_downstream_max_connections",
    ]
    actions = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]}
    assert actions == {
        "envoy.overload_actions.shrink_heap": 0.90,
        "envoy.overload_actions.disable_http_keepalive": 0.95,
        "envoy.overload_actions.stop_accepting_requests": 0.98,
    }
