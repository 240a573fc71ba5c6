"""Mesh protection as Envoy resources: rate limits, circuit breakers, fallback aggregates."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2

from control_plane.config.topology import TopologyError, parse_topology
from control_plane.model.mesh import (
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
from control_plane.routing.fallback import CircuitState, Fallbacks, step
from control_plane.telemetry.envoy import EnvoyStats
from control_plane.xds import bootstrap
from control_plane.xds.protection import RATE_LIMIT_FILTER, token_bucket
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    build_resources,
)
from control_plane.xds.snapshot import build_snapshot
from infermesh.wire import FALLBACK_HEADER

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
    listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
    names = [f.name for f in manager.http_filters]
    # gRPC-Web is on by default (tests/unit/control_plane/xds/test_edge.py)
    edge = ["envoy.filters.http.grpc_web"]
    assert names == [
        "envoy.filters.http.rbac",
        *edge,
        "infermesh.lua.openai",  # the /v1 router names the model before the affinity key
        "envoy.filters.http.lua",
        RATE_LIMIT_FILTER,
        "envoy.filters.http.router",
    ]
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
    listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
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
    # Envoy applies the aggregate's own retry limit to retries (hedges) routed through it:
    # the model's budget, not the default of 3 concurrent retries.
    (limits,) = aggregate.circuit_breakers.thresholds
    assert limits.retry_budget.budget_percent.value == 25
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
    # Freed memory goes back to the system every second (bench_hostile: RSS flat at 68 MiB
    # under 100 KiB header floods, against 1.4 GB kept without it).
    release = config["memory_allocator_manager"]
    assert release == {"bytes_to_release": 256 * 1024 * 1024, "memory_release_interval": "1s"}


# -- the control plane's circuit: fallback while Envoy overflows ------------------------------
def test_circuit_opens_on_overflow_holds_and_doubles_on_repeats() -> None:
    state, reason = step(CircuitState(), overflows=0, now=100.0)
    assert (state, reason) == (CircuitState(), None)
    state, reason = step(state, overflows=7, now=100.0)
    assert state.is_open(104.9) and not state.is_open(105.0)
    assert reason == (
        "circuit open: 7 requests refused by the circuit breaker; fallback serves for 5 s"
    )
    assert step(state, overflows=3, now=102.0) == (state, None)  # open: nothing new
    closed, reason = step(state, overflows=0, now=105.0)
    assert reason == "circuit closed: own pool serves again" and not closed.is_open(105.0)
    again, reason = step(closed, overflows=1, now=106.0)
    assert again.trips == 2 and again.open_until == 116.0  # 10 s: the second trip in a minute
    later, _ = step(CircuitState(0.0, 6, 100.0), overflows=1, now=161.0)
    assert later.trips == 1 and later.open_until == 166.0  # a minute later: forgotten
    capped, _ = step(CircuitState(0.0, 9, 100.0), overflows=1, now=101.0)
    assert capped.open_until == 101.0 + 60.0


def test_fallbacks_tick_watches_only_models_with_a_fallback() -> None:
    topology = parse_topology({"models": [{**MODEL, "fallback": "b"}, {**MODEL, "name": "b"}]})
    decisions: deque[dict[str, Any]] = deque()
    fallbacks = Fallbacks(decisions)
    asked: list[set[str]] = []

    def overflows(clusters: set[str], now: float) -> float:
        asked.append(clusters)
        return 2.0

    assert fallbacks.tick(topology, overflows, 10.0, 1000.0) == ["a"]
    assert asked == [{model_cluster("a")}]
    assert fallbacks.open_models(11.0) == {"a"}
    assert decisions[0]["pool"] == "a" and decisions[0]["decision"].startswith("circuit open")
    assert fallbacks.tick(topology, lambda c, n: 0.0, 15.0, 1005.0) == ["a"]  # closed
    assert fallbacks.open_models(15.0) == set()


def test_an_open_circuit_routes_straight_to_the_fallback() -> None:
    resources: Resources = build_resources(protected_state(fallback_active=True))
    routes = {r.name: r for r in resources[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes}
    assert routes[BIG].route.cluster == SMALL
    assert routes[model_cluster("classifier", "1")].route.cluster == SMALL
    (header,) = routes[BIG].request_headers_to_add
    assert header.header.value == "classifier-small"


def overflow_report(
    value: int, cluster: str = "model_classifier", stats: dict[str, int] | None = None
) -> Any:
    """An Envoy report with ``value`` overflows in ``cluster``, and other cluster counters."""
    resource = metrics_pb2.ResourceMetrics()
    resource.resource.attributes.add(key="telemetry.sdk.name").value.string_value = "envoy"
    scope = resource.scope_metrics.add()
    for name, count in {"cluster.upstream_rq_pending_overflow": value, **(stats or {})}.items():
        point = metrics_pb2.NumberDataPoint(as_int=count)
        point.attributes.add(key="envoy.cluster_name").value.string_value = cluster
        metric = metrics_pb2.Metric(name=name)
        metric.sum.data_points.append(point)
        scope.metrics.append(metric)
    return resource


def share(stats: EnvoyStats, model: str, now: float) -> float | None:
    """Envoy's retries per first try to ``model``'s cluster, as hedging's guard reads it."""
    return stats.retry_shares({model: [model_cluster(model)]}, now)[model]


def test_envoys_retries_per_first_try_over_the_window_for_hedgings_guard() -> None:
    stats = EnvoyStats(window_s=2.0)  # a short telemetry window: the share keeps its own
    counts = {"cluster.upstream_rq_total": 100, "cluster.upstream_rq_retry": 0}
    stats.ingest([overflow_report(0, stats=counts)], now=1.0)
    assert share(stats, "classifier", 1.5) is None  # one sample
    # 130 more requests upstream, 30 of them retries: 30 per 100 first tries; no overflow is
    # counted for them
    counts = {"cluster.upstream_rq_total": 230, "cluster.upstream_rq_retry": 30}
    stats.ingest([overflow_report(0, stats=counts)], now=2.0)
    assert share(stats, "classifier", 2.5) == 0.3
    assert share(stats, "other", 2.5) is None
    assert stats.recent_overflows({model_cluster("classifier")}, now=2.5) == 0
    calm = {"cluster.upstream_rq_total": 330, "cluster.upstream_rq_retry": 30}
    for t in range(3, 15):
        stats.ingest([overflow_report(0, stats=calm)], now=float(t))
    assert share(stats, "classifier", 14.5) is None  # no requests
    assert share(stats, "classifier", 40.0) is None  # silent Envoy


def test_every_models_retry_share_in_one_pass() -> None:
    """A routing tick asks once for every hedged model: each model's clusters (its REST twin
    with it) are summed apart from the others'."""
    stats = EnvoyStats()
    total, retry = "cluster.upstream_rq_total", "cluster.upstream_rq_retry"
    first = [overflow_report(0, c, {total: 0}) for c in ("model_a", "rest_model_a", "model_b")]
    stats.ingest(first, now=1.0)
    later = [
        overflow_report(0, "model_a", {total: 60, retry: 10}),
        overflow_report(0, "rest_model_a", {total: 50}),
        overflow_report(0, "model_b", {total: 40, retry: 20}),
    ]
    stats.ingest(later, now=2.0)
    shares = stats.retry_shares(
        {"a": ["model:a", "rest:model:a"], "b": ["model:b"], "c": ["model:c"]}, now=2.5
    )
    assert shares == {"a": 10 / 100, "b": 20 / 20, "c": None}


def test_envoy_overflows_between_its_last_two_reports() -> None:
    stats = EnvoyStats()
    stats.ingest([metrics_pb2.ResourceMetrics()], now=1.0)  # Envoy reports, nothing used yet
    stats.ingest([overflow_report(4)], now=2.0)  # first use: it was 0 at the last report
    assert stats.recent_overflows({model_cluster("classifier")}, now=2.5) == 4
    assert stats.recent_overflows({model_cluster("other")}, now=2.5) == 0
    stats.ingest([overflow_report(4)], now=3.0)
    assert stats.recent_overflows({model_cluster("classifier")}, now=3.5) == 0
    stats.ingest([overflow_report(9)], now=4.0)
    assert stats.recent_overflows({model_cluster("classifier")}, now=4.5) == 5
    assert stats.recent_overflows({model_cluster("classifier")}, now=10.0) == 0  # stale
