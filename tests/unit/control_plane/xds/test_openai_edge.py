"""The OpenAI API's Envoy configuration, built without Envoy: each model's /v1 routes (to its
REST twins, as a stream, named for the tenant rate limit), the entry routes where the body
router runs (and only there), the exposure of the /v1 paths, the Bearer step before
basic_auth, and Envoy's own replies in OpenAI's shape."""

from __future__ import annotations

import dataclasses

from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2

from control_plane.model.mesh import (
    OTHER_TENANT,
    SERVERS_CLUSTER,
    EdgeAuth,
    JwtAuth,
    ListenerOptions,
    TenantPolicy,
    rest_cluster,
)
from control_plane.xds import exposure, identity, openai_edge
from control_plane.xds.lua_routing import LUA_FILTER
from control_plane.xds.resources import build_resources, http_filters
from infermesh.wire import (
    MODEL_HEADER,
    OPENAI_CHAT_PATH,
    OPENAI_COMPLETIONS_PATH,
    VISIBLE_MODELS_HEADER,
)
from tests.unit.control_plane.xds.test_edge import manager_of, routes_of, state


def _v1(routes: list[rc_pb2.Route]) -> dict[str, rc_pb2.Route]:
    return {r.name: r for r in routes if r.name.startswith("openai:")}


def test_each_model_has_stream_routes_to_its_rest_twins() -> None:
    built = build_resources(state(rate_limit=True))
    v1 = _v1(routes_of(built))
    route = v1[f"openai:classifier:{OPENAI_COMPLETIONS_PATH}"]
    assert route.match.path == OPENAI_COMPLETIONS_PATH
    assert [(h.name, h.string_match.exact) for h in route.match.headers] == [
        (MODEL_HEADER, "classifier")
    ]
    split = [c.name for c in route.route.weighted_clusters.clusters]
    assert split and all(name.startswith(rest_cluster("")) for name in split)  # REST twins
    assert route.route.timeout.ToSeconds() == 0  # a completion streams as long as it runs
    assert route.route.idle_timeout.ToMilliseconds() == 2500  # the model's timeout_s
    assert not route.route.HasField("retry_policy")  # never replayed
    assert route.metadata.filter_metadata[identity.ROUTE_NAMESPACE]["model"] == "classifier"
    assert len(route.typed_per_filter_config) >= 2  # gRPC Lua off, the model's rate limit
    described = v1["openai:small:model"]
    assert described.match.path == "/v1/models/small"
    assert described.route.cluster == rest_cluster("model:small")


def test_the_body_router_runs_only_on_the_entry_routes_before_them() -> None:
    routes = routes_of(build_resources(state()))
    names = [r.name for r in routes]
    on = [r.name for r in routes if openai_edge.OPENAI_LUA_FILTER in r.typed_per_filter_config]
    assert on == [f"openai:no-model:{p}" for p in (OPENAI_COMPLETIONS_PATH, OPENAI_CHAT_PATH)]
    lua = lua_pb2.LuaPerRoute()
    config = routes[names.index(on[0])].typed_per_filter_config[openai_edge.OPENAI_LUA_FILTER]
    filter_config = rc_pb2.FilterConfig()
    assert config.Unpack(filter_config) and filter_config.config.Unpack(lua)
    assert lua.name == openai_edge.ROUTER_SCRIPT and not filter_config.disabled
    v1 = [n for n in names if n.startswith("openai:")]
    assert all(LUA_FILTER in routes[names.index(n)].typed_per_filter_config for n in v1)
    # A model's routes first, then the list (any server), unknown models 404, no model 400.
    assert names.index(v1[-1]) < names.index("model-not-found")  # before the gRPC routes
    models = routes[names.index("openai:models")]
    assert models.route.cluster == rest_cluster(SERVERS_CLUSTER)
    unknown = routes[names.index(f"openai:not-found:{OPENAI_CHAT_PATH}")]
    assert unknown.direct_response.status == 404
    assert routes[names.index(on[1])].direct_response.status == 400
    manager = manager_of(build_resources(state()))
    router = next(f for f in manager.http_filters if f.name == openai_edge.OPENAI_LUA_FILTER)
    assert router.disabled  # on only where a route turns it on


def test_without_body_routing_or_rest_there_is_no_router() -> None:
    off = build_resources(state(ListenerOptions(body_routing=False)))
    assert openai_edge.OPENAI_LUA_FILTER not in [f.name for f in manager_of(off).http_filters]
    assert not any(openai_edge.OPENAI_LUA_FILTER in r.typed_per_filter_config
                   for r in routes_of(off))  # fmt: skip
    no_rest = ListenerOptions(rest=dataclasses.replace(ListenerOptions().rest, enabled=False))
    assert not _v1(routes_of(build_resources(state(no_rest))))


def test_the_lua_script_names_the_wires_header_and_paths() -> None:
    source = openai_edge.lua_source()
    assert f'"{MODEL_HEADER}"' in source and '"HEADER"' not in source
    assert f'"{OPENAI_CHAT_PATH}"' in source and str(openai_edge.BODY_PREFIX_BYTES) in source
    assert "function json_field(s, key)" in openai_edge.LUA_JSON_FIELD  # for other scripts


def test_the_v1_paths_are_exposed_with_their_groups() -> None:
    inference = {r.exact for r in exposure.EXPOSABLE["inference"]}
    assert {OPENAI_COMPLETIONS_PATH, OPENAI_CHAT_PATH} <= inference
    metadata = exposure.EXPOSABLE["metadata"]
    assert any(r.exact == "/v1/models" for r in metadata)
    assert any(r.regex == "/v1/models/[^/]+" for r in metadata)


def test_envoys_own_replies_under_v1_are_openai_errors_first() -> None:
    mappers = manager_of(build_resources(state())).local_reply_config.mappers
    first = mappers[0].body_format_override.json_format["error"]
    assert set(first) == {"message", "type", "param", "code"}
    kinds = {
        m.body_format_override.json_format["error"]["type"]
        for m in mappers
        if 'prefix: "/v1/"' in str(m.filter)
    }
    assert {"authentication_error", "permission_error", "rate_limit_error",
            "not_found_error", "invalid_request_error", "server_error"} <= kinds  # fmt: skip


def test_the_bearer_step_is_for_api_keys_only() -> None:
    def filters(auth: EdgeAuth) -> list[str]:
        return [f.name for f in http_filters(True, auth=auth)]

    keys = filters(EdgeAuth(mode="api_keys"))
    assert keys.index(openai_edge.BEARER_LUA_FILTER) + 1 == keys.index(identity.BASIC_AUTH_FILTER)
    jwt = EdgeAuth(mode="jwt", jwt=JwtAuth("issuer", ("aud",), '{"keys": []}'))
    assert openai_edge.BEARER_LUA_FILTER not in filters(jwt)  # a Bearer token is a JWT there
    assert openai_edge.BEARER_LUA_FILTER not in filters(EdgeAuth())
    assert "base64Escape" in openai_edge.LUA_BEARER


def test_only_a_tenant_limited_to_some_models_has_its_list_narrowed() -> None:
    limited = (
        TenantPolicy("team-a", models=("demo_lm",)),
        TenantPolicy("team-any"),
        TenantPolicy(OTHER_TENANT, models=()),
    )
    auth = EdgeAuth(mode="api_keys", tenants=limited)
    assert openai_edge.visible_models(auth) == {"team-a": "demo_lm", OTHER_TENANT: ""}
    source = openai_edge.models_source(auth)
    assert 'local VISIBLE = {["team-a"] = "demo_lm"}' in source
    # an identity not named gets the other policy's (empty) list; a named one its own
    assert 'local NAMED = {["team-a"] = true, ["team-any"] = true}' in source
    assert 'local OTHER = ""' in source
    assert f'"{VISIBLE_MODELS_HEADER}"' in source and f'"{identity.AUTH_NAMESPACE}"' in source

    def models_route(auth: EdgeAuth) -> rc_pb2.Route:
        listener = dataclasses.replace(ListenerOptions(), auth=auth)
        return _v1(routes_of(build_resources(state(listener))))["openai:models"]

    config = models_route(auth).typed_per_filter_config[openai_edge.OPENAI_LUA_FILTER]
    filter_config, lua = rc_pb2.FilterConfig(), lua_pb2.LuaPerRoute()
    assert config.Unpack(filter_config) and filter_config.config.Unpack(lua)
    assert lua.name == openai_edge.MODELS_SCRIPT
    # body routing off: the list is narrowed all the same (its filter is there for it alone)
    listener = dataclasses.replace(ListenerOptions(), auth=auth, body_routing=False)
    built = build_resources(state(listener))
    assert openai_edge.OPENAI_LUA_FILTER in [f.name for f in manager_of(built).http_filters]
    narrowed = [r.name for r in routes_of(built)
                if openai_edge.OPENAI_LUA_FILTER in r.typed_per_filter_config]  # fmt: skip
    assert narrowed == [openai_edge.MODELS_ROUTE]
    # with authentication off, or every tenant free, the route runs no script
    for free in (EdgeAuth(), EdgeAuth(mode="api_keys", tenants=(TenantPolicy("team-any"),))):
        assert not openai_edge.visible_models(free)
        route = models_route(free)
        assert openai_edge.OPENAI_LUA_FILTER not in route.typed_per_filter_config


def test_a_tenant_named_like_a_placeholder_keeps_its_name() -> None:
    tenants = (TenantPolicy("HEADER", models=("OTHER_LIST",)), TenantPolicy("NAMESPACE"))
    source = openai_edge.models_source(EdgeAuth(mode="api_keys", tenants=tenants))
    assert 'local VISIBLE = {["HEADER"] = "OTHER_LIST"}' in source
    assert 'local NAMED = {["HEADER"] = true, ["NAMESPACE"] = true}' in source
    assert "local OTHER = nil" in source
