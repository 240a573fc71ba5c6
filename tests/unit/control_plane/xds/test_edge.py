"""Edge protocols in the Envoy resources (control_plane.xds.edge): the REST twins of every cluster,
their routes derived from the gRPC routes, gRPC-Web and CORS, and the topology options. Pure,
plus one run of the real Envoy in validate mode."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.cors.v3 import cors_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_pb2
from google.protobuf import json_format

from control_plane.config.topology import TopologyError, parse_topology_text
from control_plane.model.mesh import (
    LISTENER_NAME,
    ROUTE_CONFIG_NAME,
    SERVERS_CLUSTER,
    CorsOptions,
    EndpointAddress,
    EndpointAssignment,
    EndpointHealth,
    ListenerOptions,
    MeshState,
    ModelRoute,
    RateLimit,
    RestOptions,
    base_cluster,
    cluster_model,
    fallback_cluster,
    is_rest_cluster,
    model_cluster,
    rest_cluster,
)
from control_plane.xds import edge
from control_plane.xds.exposure import RBAC_FILTER
from control_plane.xds.incremental import SnapshotBuilder
from control_plane.xds.lua_routing import LUA_FILTER, lua_source
from control_plane.xds.openai_edge import OPENAI_LUA_FILTER
from control_plane.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    build_resources,
    route_clusters,
)
from control_plane.xds.snapshot import build_snapshot
from infermesh.wire import VERSION_HEADER
from tests.envoy_support import envoy_binary, free_port

Resources = dict[str, dict[str, Any]]
A, B, C = (EndpointAddress("10.0.0.1", 8001), EndpointAddress("10.0.0.2", 8001),
           EndpointAddress("10.0.0.3", 9000))  # fmt: skip
CORS = CorsOptions(allow_origins=("https://app.example",))


def state(
    listener: ListenerOptions | None = None,
    *,
    split: tuple[tuple[str, int], ...] = (("1", 90), ("2", 10)),
    fallback: bool = False,
    rate_limit: bool = False,
) -> MeshState:
    a = EndpointAssignment(A, weight=3)
    b = EndpointAssignment(B, weight=1, health=EndpointHealth.DRAINING)
    c = EndpointAssignment(C, weight=7, health=EndpointHealth.UNHEALTHY)
    classifier = ModelRoute(
        "classifier", 50, 2.5, split,
        rate_limit=RateLimit(10, 10) if rate_limit else None,
        fallback="small" if fallback else None,
    )  # fmt: skip
    return MeshState(
        listener=listener or ListenerOptions(cors=CORS),
        models=(classifier, ModelRoute("small", 20, 1.0)),
        clusters={
            SERVERS_CLUSTER: (a, b, c),
            model_cluster("classifier"): (a, b, c),
            model_cluster("classifier", "1"): (a, b),
            model_cluster("classifier", "2"): (c,),
            model_cluster("small"): (),
        },
    )


def route_config(built: dict[str, Any]) -> Any:
    """The one RouteConfiguration of a build."""
    return built[ROUTE_TYPE][ROUTE_CONFIG_NAME]


def routes_of(built: Resources) -> list[rc_pb2.Route]:
    return list(built[ROUTE_TYPE][ROUTE_CONFIG_NAME].virtual_hosts[0].routes)


def manager_of(built: Resources) -> hcm_pb2.HttpConnectionManager:
    manager = hcm_pb2.HttpConnectionManager()
    listener = built[LISTENER_TYPE][LISTENER_NAME]
    assert listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
    return manager


def endpoints(load: Any) -> list[tuple[str, int, int, int]]:
    return [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value,
         e.load_balancing_weight.value, e.health_status)
        for group in load.endpoints for e in group.lb_endpoints
    ]  # fmt: skip


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grpc", "rest"),
    [
        ("servers", "rest:servers"),
        ("model:m", "rest:model:m"),
        ("model:m:v2", "rest:model:m:v2"),
        ("fallback:model:m", "fallback:rest:model:m"),
        ("fallback:model:m:v1", "fallback:rest:model:m:v1"),
    ],
)
def test_rest_cluster_names(grpc: str, rest: str) -> None:
    assert rest_cluster(grpc) == rest and base_cluster(rest) == grpc
    assert is_rest_cluster(rest) and not is_rest_cluster(grpc)
    assert cluster_model(rest) == cluster_model(grpc)


# --- endpoints: the REST assignments mirror the gRPC ones -----------------------------------


@pytest.mark.parametrize(
    ("offset", "ports", "expected"),
    [
        (2000, [8001, 8002], [10001, 10002]),
        (-1000, [8001, 1500], [7001, 500]),
        (1, [65534, 65535], [65535]),  # a REST port past 65535 is left out
        (-8001, [8001, 8002], [1]),  # and one below 1
    ],
)
def test_rest_assignments_shift_ports_and_keep_weight_and_health(
    offset: int, ports: list[int], expected: list[int]
) -> None:
    healths = [EndpointHealth.HEALTHY, EndpointHealth.DRAINING]
    given = [
        EndpointAssignment(EndpointAddress("10.0.0.9", p), weight=i + 2, health=healths[i])
        for i, p in enumerate(ports)
    ]
    shifted = edge.rest_assignments(given, offset)
    assert [a.address.port for a in shifted] == expected
    kept = [a for a in given if a.address.port + offset in expected]
    assert [(a.address.host, a.weight, a.health) for a in shifted] == [
        (a.address.host, a.weight, a.health) for a in kept
    ]


@pytest.mark.parametrize(
    "mesh",
    [
        state(),
        state(split=()),
        state(fallback=True),
        state(ListenerOptions(rest=RestOptions(port_offset=-5))),
        state(ListenerOptions(rest=RestOptions(port_offset=100), body_routing=False)),
    ],
    ids=["split", "no-split", "fallback", "negative-offset", "no-body-routing"],
)
def test_every_cluster_has_a_rest_twin_with_the_same_endpoints_ports_shifted(
    mesh: MeshState,
) -> None:
    built: Resources = build_resources(mesh)
    offset = mesh.listener.rest.port_offset
    eds = built[ENDPOINT_TYPE]
    grpc = [name for name in eds if not is_rest_cluster(name)]
    assert sorted(eds) == sorted(grpc + [rest_cluster(name) for name in grpc])
    for name in grpc:
        mirrored = [(h, p + offset, w, s) for h, p, w, s in endpoints(eds[name])]
        assert endpoints(eds[rest_cluster(name)]) == mirrored, name
        assert eds[rest_cluster(name)].cluster_name == rest_cluster(name)
        overprovisioning = eds[name].policy.overprovisioning_factor.value
        assert eds[rest_cluster(name)].policy.overprovisioning_factor.value == overprovisioning
    routed = route_clusters(built[ROUTE_TYPE][ROUTE_CONFIG_NAME])
    assert routed <= set(built[CLUSTER_TYPE])
    build_snapshot(built)  # consistent: every EDS name a cluster, every routed cluster exists


def test_rest_off_builds_the_grpc_mesh_only() -> None:
    built: Resources = build_resources(state(ListenerOptions(rest=RestOptions(enabled=False))))
    assert not any(is_rest_cluster(n) for n in built[CLUSTER_TYPE])
    assert not any(r.name.startswith("rest:") for r in routes_of(built))
    *mappers, on_grpc = manager_of(built).local_reply_config.mappers  # no REST JSON
    assert len(mappers) == 2 and all("not exposed" in str(m.body_format_override) for m in mappers)
    assert (
        on_grpc.body_format_override.text_format_source.inline_string == edge.RATE_LIMITED_MESSAGE
    )


# --- clusters -------------------------------------------------------------------------------


def test_rest_clusters_speak_http1_and_check_v2_health_ready() -> None:
    built: Resources = build_resources(state())
    for name, cluster in built[CLUSTER_TYPE].items():
        if cluster.HasField("cluster_type"):  # a fallback aggregate
            continue
        options = http_pb2.HttpProtocolOptions()
        assert cluster.typed_extension_protocol_options[edge.HTTP_PROTOCOL_OPTIONS].Unpack(options)
        (check,) = cluster.health_checks
        if is_rest_cluster(name):
            assert options.explicit_http_config.HasField("http_protocol_options")
            assert check.http_health_check.path == "/v2/health/ready"
            assert not check.HasField("grpc_health_check")
            assert not cluster.HasField("track_cluster_stats")
        else:
            assert options.explicit_http_config.HasField("http2_protocol_options")
            assert check.HasField("grpc_health_check")
        twin = built[CLUSTER_TYPE][rest_cluster(base_cluster(name))]
        assert twin.circuit_breakers == cluster.circuit_breakers
        assert twin.outlier_detection == cluster.outlier_detection


def test_fallback_aggregates_have_rest_twins() -> None:
    built: Resources = build_resources(state(fallback=True, split=()))
    aggregate = built[CLUSTER_TYPE][fallback_cluster(rest_cluster(model_cluster("classifier")))]
    config = aggregate.cluster_type.typed_config.value
    assert b"rest:model:classifier" in config and b"rest:model:small" in config


# --- routes ---------------------------------------------------------------------------------


def test_rest_routes_come_first_and_only_match_v2_paths() -> None:
    routes = routes_of(build_resources(state()))
    preflight = routes.pop(0)  # with CORS: preflights first, any path
    assert preflight.name == "cors-preflight"
    assert [h.name for h in preflight.match.headers] == [
        ":method", "origin", "access-control-request-method"
    ]  # fmt: skip
    rest = [r for r in routes if r.name.startswith("rest:")]
    assert routes[: len(rest)] == rest  # before any gRPC route: x-model-name may be sent
    for item in rest:
        path = item.match.path_separated_prefix or item.match.path or item.match.prefix
        assert path.startswith("/v2"), item.name
    names = [r.name for r in rest]
    v1, v2, model = (model_cluster("classifier", "1"), model_cluster("classifier", "2"),
                     model_cluster("classifier"))  # fmt: skip
    assert names[:4] == [f"rest:{v1}:path", f"rest:{v2}:path", f"rest:{v1}:header",
                         f"rest:{v2}:header"]  # fmt: skip
    assert names[4:] == [f"rest:{model}", f"rest:{model_cluster('small')}", "rest:server:stats",
                         "rest:model-not-found", "rest:server"]  # fmt: skip
    by_name = {r.name: r for r in rest}
    assert by_name[f"rest:{v2}:path"].match.path_separated_prefix == (
        "/v2/models/classifier/versions/2"
    )
    header = by_name[f"rest:{v2}:header"].match
    assert header.path_separated_prefix == "/v2/models/classifier"
    assert [(h.name, h.string_match.exact) for h in header.headers] == [(VERSION_HEADER, "2")]
    assert by_name["rest:server"].route.cluster == rest_cluster(SERVERS_CLUSTER)
    assert by_name["rest:model-not-found"].direct_response.status == 404


@pytest.mark.parametrize("fallback", [False, True])
def test_rest_routes_carry_the_grpc_routes_split_limits_and_timeouts(fallback: bool) -> None:
    routes = {r.name: r for r in routes_of(build_resources(state(rate_limit=True,
                                                                 fallback=fallback)))}  # fmt: skip
    for name in (model_cluster("classifier"), model_cluster("classifier", "2")):
        grpc = routes[name]
        derived = [f"rest:{name}{kind}" for kind in ("", ":path", ":header")]
        for rest in [routes[n] for n in derived if n in routes]:
            assert rest.route.timeout == grpc.route.timeout
            assert rest.route.cluster == (rest_cluster(grpc.route.cluster)
                                          if grpc.route.cluster else "")  # fmt: skip
            pairs = [(c.name, c.weight.value, list(c.request_headers_to_add))
                     for c in grpc.route.weighted_clusters.clusters]  # fmt: skip
            assert [(c.name, c.weight.value, list(c.request_headers_to_add))
                    for c in rest.route.weighted_clusters.clusters] == [
                (rest_cluster(n), w, h) for n, w, h in pairs
            ]  # fmt: skip
            assert dict(rest.typed_per_filter_config) == dict(grpc.typed_per_filter_config)
            assert list(rest.request_headers_to_add) == list(grpc.request_headers_to_add)
            retry = rest.route.retry_policy
            assert retry.retry_on == edge.REST_RETRY_ON and list(retry.retriable_status_codes) == [
                503
            ]
            assert retry.num_retries == grpc.route.retry_policy.num_retries
    split = routes[f"rest:{model_cluster('classifier')}"].route.weighted_clusters.clusters
    assert [(c.weight.value, c.request_headers_to_add[0].header.value) for c in split] == [
        (90, "1"), (10, "2")
    ]  # fmt: skip


# --- listener, gRPC-Web, CORS ---------------------------------------------------------------


def test_listener_filters_and_json_local_replies_for_rest() -> None:
    manager = manager_of(build_resources(state(rate_limit=True)))
    assert manager.codec_type == hcm_pb2.HttpConnectionManager.AUTO  # HTTP/1.1 and HTTP/2
    assert [f.name for f in manager.http_filters] == [
        RBAC_FILTER, edge.GRPC_WEB_FILTER, OPENAI_LUA_FILTER, LUA_FILTER,  # /v1 router first
        edge.CORS_FILTER,  # CORS after Lua
        "envoy.filters.http.local_ratelimit", "envoy.filters.http.router",
    ]  # fmt: skip
    *openai, refused, _refused_grpc, limited, other, on_grpc = manager.local_reply_config.mappers
    assert len(openai) == 10  # the OpenAI API's (/v1 only: control_plane.xds.openai_edge) first
    assert all('prefix: "/v1/"' in str(m.filter) for m in openai)
    assert "not exposed" in refused.body_format_override.json_format["error"]
    assert limited.body_format_override.json_format["error"] == edge.RATE_LIMITED_MESSAGE
    assert other.body_format_override.json_format["error"] == "%LOCAL_REPLY_BODY%"
    text = on_grpc.body_format_override.text_format_source.inline_string
    assert text == edge.RATE_LIMITED_MESSAGE  # after REST's: gRPC calls only
    assert other.filter.header_filter.header.string_match.prefix == "/v2"  # gRPC untouched
    off = manager_of(build_resources(state(ListenerOptions(grpc_web=False))))
    assert edge.GRPC_WEB_FILTER not in [f.name for f in off.http_filters]
    assert edge.CORS_FILTER not in [f.name for f in off.http_filters]


def test_cors_policy_on_the_virtual_host() -> None:
    options = CorsOptions(("https://a.example", "*"), ("content-type",), ("grpc-status",), 60)
    built = build_resources(state(ListenerOptions(cors=options)))
    host = route_config(built).virtual_hosts[0]
    policy = cors_pb2.CorsPolicy()
    assert host.typed_per_filter_config[edge.CORS_FILTER].Unpack(policy)
    matchers = [json_format.MessageToDict(m) for m in policy.allow_origin_string_match]
    assert matchers == [{"exact": "https://a.example"}, {"safeRegex": {"regex": ".*"}}]
    assert (policy.allow_headers, policy.expose_headers, policy.max_age) == (
        "content-type", "grpc-status", "60"
    )  # fmt: skip
    none = route_config(build_resources(state(ListenerOptions())))
    assert edge.CORS_FILTER not in none.virtual_hosts[0].typed_per_filter_config
    assert "cors-preflight" not in [r.name for r in none.virtual_hosts[0].routes]
    assert not policy.forward_not_matching_preflights.value  # Envoy answers every preflight


def test_lua_routes_by_path_not_content_type() -> None:
    # gRPC-Web reaches the Lua filter as gRPC (the grpc_web filter runs first): no content-type
    # test may keep it from body routing.
    assert "content-type" not in lua_source().lower()


def versions(snapshot: Any) -> dict[str, str]:
    return {type_url: typed.version for type_url, typed in snapshot.resources.items()}


# --- incremental ----------------------------------------------------------------------------


def test_incremental_builder_remakes_a_pools_grpc_and_rest_assignments_together() -> None:
    builder = SnapshotBuilder()
    first = state()
    builder.build(first)
    clusters = dict(first.clusters)
    name = model_cluster("classifier", "1")
    clusters[name] = tuple(dataclasses.replace(a, weight=9) for a in clusters[name])
    snapshot = builder.build(dataclasses.replace(first, clusters=clusters))
    assert builder.made == 2  # the pool's assignment and its REST twin's, nothing else
    full = build_snapshot(build_resources(dataclasses.replace(first, clusters=clusters)))
    assert versions(snapshot) == versions(full)
    moved = dataclasses.replace(first.listener, rest=RestOptions(port_offset=3000))
    builder.build(dataclasses.replace(first, listener=moved))
    made = builder.made
    rest = [n for n in full.resources[ENDPOINT_TYPE].items if is_rest_cluster(n)]
    assert made >= 2 * len(rest)  # the offset changes every REST cluster and assignment


# --- topology -------------------------------------------------------------------------------

BASE = "models: [{name: m, sla_p99_ms: 5, capacity_qps: 10}]\n"


def test_topology_defaults_and_options() -> None:
    default = parse_topology_text(BASE).listener
    assert default.rest == RestOptions(True, 2000) and default.grpc_web and default.cors is None
    text = BASE + (
        "listener: {rest: {enabled: false, port_offset: -100}, grpc_web: false,\n"
        "  cors: {allow_origins: ['https://a.example:8443', '*'], allow_headers: [X-A],\n"
        "         expose_headers: [grpc-status], max_age_s: 0}}\n"
    )
    listener = parse_topology_text(text).listener
    assert listener.rest == RestOptions(False, -100) and not listener.grpc_web
    assert listener.cors == CorsOptions(("https://a.example:8443", "*"), ("x-a",),
                                        ("grpc-status",), 0)  # fmt: skip
    minimal = parse_topology_text(BASE + "listener: {cors: {allow_origins: ['*']}}").listener
    assert minimal.cors is not None
    assert minimal.cors.expose_headers == ("grpc-status", "grpc-message", "retry-after")
    assert "authorization" in minimal.cors.allow_headers  # a browser sends its key


@pytest.mark.parametrize(
    ("listener", "error"),
    [
        ("{rest: {port_offset: 0}}", "listener.rest.port_offset: must be a non-zero integer"),
        ("{rest: {port_offset: 70000}}", "listener.rest.port_offset: must be a non-zero"),
        ("{rest: {port_offset: 1.5}}", "listener.rest.port_offset: must be a non-zero"),
        ("{rest: {enabled: yes please}}", "listener.rest.enabled: must be true or false"),
        ("{rest: {port: 1}}", "listener.rest.port: unknown key"),
        ("{rest: 3}", "listener.rest: must be a mapping"),
        ("{grpc_web: 1}", "listener.grpc_web: must be true or false"),
        ("{cors: {}}", "listener.cors.allow_origins: required"),
        ("{cors: {allow_origins: []}}", "listener.cors.allow_origins: must list at least one"),
        ("{cors: {allow_origins: [app.example]}}", "listener.cors.allow_origins[0]: must be an"),
        ("{cors: {allow_origins: ['https://a/b']}}", "listener.cors.allow_origins[0]: must be"),
        ("{cors: {allow_origins: ['*'], allow_headers: ['a b']}}",
         "listener.cors.allow_headers[0]: must be a header name"),
        ("{cors: {allow_origins: ['*'], expose_headers: x}}",
         "listener.cors.expose_headers: must be a list"),
        ("{cors: {allow_origins: ['*'], max_age_s: -1}}", "listener.cors.max_age_s: must be"),
        ("{cors: {allow_origins: ['*'], origin: x}}", "listener.cors.origin: unknown key"),
    ],
)  # fmt: skip
def test_topology_errors(listener: str, error: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology_text(BASE + f"listener: {listener}\n")
    assert any(e.startswith(error) for e in info.value.errors), info.value.errors
    assert len(info.value.errors) == 1, info.value.errors


def test_static_endpoints_whose_rest_port_is_not_a_port_are_errors() -> None:
    text = BASE + "endpoints: [{address: 127.0.0.1:64000}, {address: 127.0.0.1:8001}]\n"
    with pytest.raises(TopologyError) as info:
        parse_topology_text(text)
    assert info.value.errors == (
        "endpoints[0].address: REST port 64000 + listener.rest.port_offset 2000 = 66000 is not "
        "a port in 1..65535 (change the offset or set listener.rest.enabled: false)",
    )
    parse_topology_text(text + "listener: {rest: {enabled: false}}\n")  # fine without REST


# --- the real Envoy accepts it --------------------------------------------------------------


def static_bootstrap(built: Resources, admin_port: int) -> dict[str, Any]:
    """Every resource inlined (no xDS): aggregates as they are, EDS clusters made STATIC."""
    listeners = []
    for source in built[LISTENER_TYPE].values():
        listener = listener_pb2.Listener()
        listener.CopyFrom(source)
        manager = hcm_pb2.HttpConnectionManager()
        listener.filter_chains[0].filters[-1].typed_config.Unpack(manager)
        manager.ClearField("rds")
        manager.route_config.CopyFrom(built[ROUTE_TYPE][ROUTE_CONFIG_NAME])
        listener.filter_chains[0].filters[-1].typed_config.Pack(manager)
        listeners.append(json_format.MessageToDict(listener, preserving_proto_field_name=True))
    clusters = []
    for name, source in built[CLUSTER_TYPE].items():
        cluster = cluster_pb2.Cluster()
        cluster.CopyFrom(source)
        if not cluster.HasField("cluster_type"):
            cluster.ClearField("eds_cluster_config")
            cluster.type = cluster_pb2.Cluster.STATIC
            cluster.load_assignment.CopyFrom(built[ENDPOINT_TYPE][name])
        clusters.append(json_format.MessageToDict(cluster, preserving_proto_field_name=True))
    address = {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
    return {
        "node": {"id": "test-envoy", "cluster": "infermesh-test"},
        "admin": {"address": address},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


@pytest.mark.integration
@pytest.mark.parametrize("fallback", [False, True])
def test_envoy_accepts_rest_grpc_web_and_cors(tmp_path: Path, fallback: bool) -> None:
    mesh = state(rate_limit=True, fallback=fallback)
    path = tmp_path / "static.json"
    path.write_text(json.dumps(static_bootstrap(build_resources(mesh), free_port())))
    command = [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_listener_limits_reach_envoy_and_bad_ones_are_named() -> None:
    text = (
        "listener:\n  limits: {max_request_headers_kb: 32, max_concurrent_streams: 50,\n"
        "           request_headers_timeout_s: 2.5, max_stream_duration_s: 30}\n"
        "models: [{name: classifier, sla_p99_ms: 50, capacity_qps: 100}]\n"
    )
    listener = parse_topology_text(text).listener
    built: Resources = build_resources(state(listener))
    manager = manager_of(built)
    assert manager.max_request_headers_kb.value == 32
    assert manager.http2_protocol_options.max_concurrent_streams.value == 50
    assert manager.request_headers_timeout.ToTimedelta().total_seconds() == 2.5
    options = manager.common_http_protocol_options
    assert options.max_stream_duration.seconds == 30 and options.max_headers_count.value == 100
    assert manager.normalize_path.value and manager.merge_slashes
    (envoy_listener,) = built[LISTENER_TYPE].values()
    assert envoy_listener.per_connection_buffer_limit_bytes.value == 32 * 1024
    assert len(envoy_listener.filter_chains[0].filters) == 1  # no connection bucket by default
    with_rate = dataclasses.replace(
        listener, limits=dataclasses.replace(listener.limits, max_new_connections_per_s=300)
    )
    rated: Any = build_resources(state(with_rate))[LISTENER_TYPE][LISTENER_NAME]
    first = rated.filter_chains[0].filters[0]  # new connections, before any HTTP
    bucket = local_rate_limit_pb2.LocalRateLimit()
    assert first.name == "envoy.filters.network.local_ratelimit"
    assert first.typed_config.Unpack(bucket) and bucket.token_bucket.max_tokens == 300
    streams = [r for r in routes_of(built) if r.match.path.endswith("/ModelStreamInfer")]
    assert streams and all(
        r.route.max_stream_duration.max_stream_duration.ToTimedelta().total_seconds() == 0
        for r in streams
    )  # a generation may last longer than a unary request
    bad = (
        "listener:\n  limits: {max_request_headers_kb: 9000, max_concurrent_streams: 0,\n"
        "           request_headers_timeout_s: -1, burst: 3}\n"
        "models: [{name: classifier, sla_p99_ms: 50, capacity_qps: 100}]\n"
    )
    with pytest.raises(TopologyError) as caught:
        parse_topology_text(bad)
    errors = "\n".join(caught.value.errors)
    for expected in (
        "listener.limits.burst: unknown key",
        "listener.limits.max_request_headers_kb: must be in 1..8192, got 9000",
        "listener.limits.max_concurrent_streams: must be in 1..2147483647, got 0",
        "listener.limits.request_headers_timeout_s: must be > 0, got -1",
    ):
        assert expected in errors, errors


def test_expose_names_groups_and_refuses_model_control() -> None:
    models = "models: [{name: classifier, sla_p99_ms: 50, capacity_qps: 100}]\n"
    listener = parse_topology_text(
        "listener: {expose: [inference, statistics]}\n" + models
    ).listener
    assert listener.expose == ("inference", "statistics")
    assert parse_topology_text(models).listener.expose == ("inference", "metadata", "health")
    with pytest.raises(TopologyError) as caught:
        parse_topology_text("listener: {expose: [inference, model-repository, everything]}\n"
                            + models)  # fmt: skip
    errors = "\n".join(caught.value.errors)
    assert "listener.expose[1]: is never exposed on the public listener" in errors
    assert "listener.expose[2]: must be one of health, metadata, inference" in errors
    with pytest.raises(TopologyError, match="must name at least one API group"):
        parse_topology_text("listener: {expose: []}\n" + models)
