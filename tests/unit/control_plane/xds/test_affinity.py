"""Affinity in the generated Envoy configuration: Maglev with bounded load on the model's
clusters, a hash policy on its routes, the Lua on them, and the same bytes from every build."""

from __future__ import annotations

import dataclasses

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2

from control_plane.model.mesh import (
    Affinity,
    MeshState,
    RestOptions,
    model_cluster,
    rest_cluster,
)
from control_plane.xds import affinity
from control_plane.xds.lua_routing import LUA_FILTER, lua_source
from control_plane.xds.resources import BODY_BUFFER_LIMIT_BYTES, build_resources
from control_plane.xds.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE
from infermesh.wire import AFFINITY_HEADER
from tests.unit.control_plane.xds.meshes import V1, V2, mesh_state
from tests.unit.control_plane.xds.test_resources import manager_of, routes_of

PREFIX = Affinity("prefix", prefix_blocks=4, hash_balance_factor=125)


def with_affinity(
    state: MeshState, chosen: Affinity | None = PREFIX, **listener: object
) -> MeshState:
    classifier = dataclasses.replace(state.models[0], affinity=chosen)
    options = dataclasses.replace(state.listener, **listener)  # type: ignore[arg-type]
    return dataclasses.replace(state, models=(classifier, *state.models[1:]), listener=options)


def lua_disabled(route: object) -> bool:
    config = route.typed_per_filter_config.get(LUA_FILTER)  # type: ignore[attr-defined]
    if config is None:
        return False
    per_route = lua_pb2.LuaPerRoute()
    config.Unpack(per_route)
    return per_route.disabled


def test_the_models_clusters_hash_with_bounded_load_and_others_do_not() -> None:
    state = with_affinity(mesh_state(), rest=RestOptions())
    clusters = build_resources(state)[CLUSTER_TYPE]
    hashed = {model_cluster("classifier"), V1, V2}
    hashed |= {rest_cluster(name) for name in hashed}
    for name, cluster in clusters.items():
        assert isinstance(cluster, cluster_pb2.Cluster)
        if name in hashed:
            assert cluster.lb_policy == cluster_pb2.Cluster.MAGLEV, name
            bounded = cluster.common_lb_config.consistent_hashing_lb_config
            assert bounded.hash_balance_factor.value == 125
            assert cluster.common_lb_config.healthy_panic_threshold.value == 0  # still no panic
        else:
            assert cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST, name


def test_weights_and_health_reach_the_hashed_clusters_unchanged() -> None:
    plain = build_resources(mesh_state())[ENDPOINT_TYPE]
    hashed = build_resources(with_affinity(mesh_state()))[ENDPOINT_TYPE]
    assert plain == hashed  # ejection, drain and slow start act through these
    assignment = hashed[model_cluster("classifier")]
    assert isinstance(assignment, endpoint_pb2.ClusterLoadAssignment)
    members = assignment.endpoints[0].lb_endpoints
    assert [m.load_balancing_weight.value for m in members] == [3, 1]
    assert members[1].health_status == health_check_pb2.DRAINING


def test_the_models_routes_hash_on_the_edges_key_with_the_lua_on() -> None:
    state = with_affinity(mesh_state(), rest=RestOptions())
    routes = routes_of(build_resources(state))
    for route in routes:
        is_classifier = "classifier" in route.name and route.HasField("route")
        policies = [p.header.header_name for p in route.route.hash_policy]
        if is_classifier:
            assert policies == [AFFINITY_HEADER], route.name
            assert not lua_disabled(route), route.name
        else:
            assert policies == [], route.name
    streams = [r for r in routes if r.name.endswith(":stream") and "classifier" in r.name]
    assert streams and all(not r.route.HasField("retry_policy") for r in streams)
    # canaries: the version split still holds, each version's cluster hashed the same way
    split = next(r for r in routes if r.name == model_cluster("classifier"))
    assert [c.name for c in split.route.weighted_clusters.clusters] == [V1, V2]


def test_lua_only_for_affinity_when_body_routing_is_off() -> None:
    built = build_resources(with_affinity(mesh_state(), body_routing=False))
    manager = manager_of(built[LISTENER_TYPE]["infermesh"])
    assert LUA_FILTER in [f.name for f in manager.http_filters]
    window = manager.http2_protocol_options.initial_stream_window_size.value
    assert window == BODY_BUFFER_LIMIT_BYTES  # the bodies it buffers fit
    routes = {r.name: r for r in routes_of(built)}
    assert lua_disabled(routes["no-model-name"])
    assert not lua_disabled(routes[model_cluster("classifier")])
    off = build_resources(dataclasses.replace(mesh_state(), listener=dataclasses.replace(
        mesh_state().listener, body_routing=False)))  # fmt: skip
    assert LUA_FILTER not in [
        f.name for f in manager_of(off[LISTENER_TYPE]["infermesh"]).http_filters
    ]


def test_every_build_is_the_same_bytes() -> None:
    """Control-plane replicas agree: the configuration is a function of topology and weights."""

    def serialized() -> dict[str, dict[str, bytes]]:
        built = build_resources(with_affinity(mesh_state()))
        return {
            kind: {name: m.SerializeToString(deterministic=True) for name, m in items.items()}
            for kind, items in built.items()
        }

    assert serialized() == serialized()


def test_lua_script_carries_each_models_settings() -> None:
    chat = Affinity("session", session_header="x-conversation", one_request_streams=True)
    table = affinity.lua_table([("lm", PREFIX), ("chat", chat)])
    assert table == (
        '{["chat"] = {session = true, bytes = 128, block = 16, header = "x-conversation", '
        'streams = true}, ["lm"] = {session = false, bytes = 64, block = 16, '
        'header = "x-session-id", streams = false}}'
    )
    source = lua_source([("lm", PREFIX)])
    assert table.split(", [")[1].rstrip("}") in source and "set_affinity" in source
    assert "set_affinity" not in lua_source()  # no affinity: the routing script as before
    listener = build_resources(with_affinity(mesh_state()))[LISTENER_TYPE]["infermesh"]
    lua = next(f for f in manager_of(listener).http_filters if f.name == LUA_FILTER)
    config = lua_pb2.Lua()
    lua.typed_config.Unpack(config)
    assert (
        '["classifier"] = {session = false, bytes = 64' in config.default_source_code.inline_string
    )


def test_changing_affinity_rebuilds_the_routes_clusters_and_listener() -> None:
    one = build_resources(with_affinity(mesh_state()))
    other = build_resources(
        with_affinity(mesh_state(), dataclasses.replace(PREFIX, prefix_blocks=2))
    )
    assert one[LISTENER_TYPE] != other[LISTENER_TYPE]  # the Lua table
    assert one[ROUTE_TYPE] == other[ROUTE_TYPE]
    bounded = with_affinity(mesh_state(), dataclasses.replace(PREFIX, hash_balance_factor=200))
    assert build_resources(bounded)[CLUSTER_TYPE] != one[CLUSTER_TYPE]


def test_a_model_named_like_a_placeholder_keeps_its_name() -> None:
    """The script's placeholders ("HEADER", "VERSION_HEADER") are filled before the models'
    names go in: a model so named keeps its affinity."""
    source = lua_source([("HEADER", PREFIX), ("VERSION_HEADER", PREFIX)])
    assert '{["HEADER"] = {session = false' in source and '["VERSION_HEADER"] = {' in source
