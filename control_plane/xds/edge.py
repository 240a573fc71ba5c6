"""Edge protocols on the mesh's one listener, next to gRPC: KServe v2 REST and gRPC-Web (+ CORS).

- **REST** (``listener.rest``, on by default): ``/v2/...`` paths are routed before the gRPC
  routes. Each model route's REST routes are *derived from its gRPC route* (``rest_routes``):
  the same match by model (from the path ``/v2/models/M``) and version (``/versions/V`` in the
  path, or the ``x-model-version`` header), the same action (timeout, version split with the
  ``x-model-version`` it adds, fallback aggregate) with every cluster renamed to its REST twin
  (``control_plane.model.mesh.rest_cluster``), the same per-route rate limit and fallback header.
  A twin's endpoints are the gRPC cluster's ``EndpointAssignment`` tuple with each port shifted
  by ``port_offset`` (``rest_assignments``, the only place that derives them), so weights,
  drains and ejections cannot diverge. Twins speak HTTP/1.1 (aiohttp) and are health-checked
  with ``GET /v2/health/ready``. Server-level paths go to ``rest:servers``; a model the mesh
  does not route gets 404. Envoy's own replies to REST requests (no healthy upstream 503, rate
  limited 429, overflow 503, unknown model 404) are JSON ``{"error": ...}``
  (``local_reply_config``); gRPC local replies are untouched.
- **gRPC-Web** (``listener.grpc_web``, on by default): Envoy's grpc_web filter turns gRPC-Web
  (binary and text) into gRPC before the body-routing Lua filter, so header-less gRPC-Web
  calls are body-routed like gRPC ones.
- **CORS** (``listener.cors``, off unless given): a CorsPolicy on the virtual host.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, protocol_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.cors.v3 import cors_pb2
from envoy.extensions.filters.http.grpc_web.v3 import grpc_web_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as http_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2

from control_plane.model.mesh import (
    CorsOptions,
    EndpointAddress,
    EndpointAssignment,
    RestOptions,
    rest_cluster,
)
from control_plane.model.schema import Checker
from control_plane.xds.envoy_values import packed
from control_plane.xds.lua_routing import LUA_FILTER
from infermesh.wire import MODEL_HEADER, VERSION_HEADER

GRPC_WEB_FILTER = "envoy.filters.http.grpc_web"
CORS_FILTER = "envoy.filters.http.cors"
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
REST_ROOT = "/v2"
MODELS_PATH = "/v2/models"
REST_HEALTH_PATH = "/v2/health/ready"
# The REST counterpart of the gRPC routes' retry_on: a 503 is what UNAVAILABLE maps to.
REST_RETRY_ON = "reset,connect-failure,refused-stream,retriable-status-codes"
REST_RETRY_ON_NOT_IDEMPOTENT = "connect-failure,refused-stream,retriable-status-codes"
REST_RETRY_STATUS = 503
REST_NOT_FOUND_MESSAGE = "model not found in the mesh"
RATE_LIMITED_MESSAGE = (
    "rate limited: over the request rate of the model, or of your tenant on it, in the mesh; "
    "retry after the seconds in retry-after (x-infermesh-rate-limited says which limit)"
)
CORS_METHODS = "GET, POST, OPTIONS"
MAX_PORT = 65535


# --- endpoints ------------------------------------------------------------------------------


def rest_assignments(
    assignments: Iterable[EndpointAssignment],
    offset: int,
    ports: Mapping[EndpointAddress, int] | None = None,
) -> tuple[EndpointAssignment, ...]:
    """The REST twin of a cluster's endpoints: each port + ``offset`` (or the endpoint's own
    REST port in ``ports``), weight, health and priority the same; an endpoint whose REST port
    would fall outside 1..65535 is left out."""
    ports = ports or {}
    moved = [(a, ports.get(a.address, a.address.port + offset)) for a in assignments]
    return tuple(_on_port(a, port) for a, port in moved if 1 <= port <= MAX_PORT)


@functools.lru_cache(maxsize=1 << 16)
def _on_port(assignment: EndpointAssignment, port: int) -> EndpointAssignment:
    """One object per twin assignment, which also keeps ``clusters.lb_endpoint``'s cache
    hitting: the twin of `servers` at 10,000 endpoints took 50 ms with ``dataclasses.replace``
    and takes 3 ms (side by side in one process)."""
    a = assignment
    return EndpointAssignment(
        EndpointAddress(a.address.host, port), a.weight, a.health, a.priority, a.address.port
    )


# --- clusters -------------------------------------------------------------------------------


def make_rest_cluster(cluster: cluster_pb2.Cluster) -> cluster_pb2.Cluster:
    """Turns a model (or servers) cluster into its REST twin, in place: HTTP/1.1 upstreams,
    an HTTP health check of ``/v2/health/ready`` (503 while a server is not ready or drains).
    No per-endpoint stats: the REST ports are not the endpoints telemetry knows."""
    explicit = http_pb2.HttpProtocolOptions.ExplicitHttpConfig(
        http_protocol_options=protocol_pb2.Http1ProtocolOptions()
    )
    options = packed(http_pb2.HttpProtocolOptions(explicit_http_config=explicit))
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(options)
    for check in cluster.health_checks:
        check.ClearField("grpc_health_check")
        check.http_health_check.path = REST_HEALTH_PATH
    cluster.ClearField("track_cluster_stats")
    return cluster


# --- routes ---------------------------------------------------------------------------------


def _header_value(match: rc_pb2.RouteMatch, name: str) -> str | None:
    for header in match.headers:
        if header.name == name and header.string_match.exact:
            return str(header.string_match.exact)
    return None


def rest_action(action: rc_pb2.RouteAction) -> rc_pb2.RouteAction:
    """The same action to the REST twins of its clusters, with REST's retry conditions."""
    result = rc_pb2.RouteAction()
    result.CopyFrom(action)
    if result.cluster:
        result.cluster = rest_cluster(result.cluster)
    for entry in result.weighted_clusters.clusters:
        entry.name = rest_cluster(entry.name)
    if result.HasField("retry_policy"):  # a route that never retries a reset keeps to that
        on_reset = "reset" in result.retry_policy.retry_on.split(",")
        result.retry_policy.retry_on = REST_RETRY_ON if on_reset else REST_RETRY_ON_NOT_IDEMPOTENT
        result.retry_policy.retriable_status_codes[:] = [REST_RETRY_STATUS]
    return result


def _lua_off(item: rc_pb2.Route) -> rc_pb2.Route:
    item.typed_per_filter_config[LUA_FILTER].Pack(lua_pb2.LuaPerRoute(disabled=True))
    return item


def _derived(name: str, match: rc_pb2.RouteMatch, grpc: rc_pb2.Route) -> rc_pb2.Route:
    item = rc_pb2.Route(name=name, match=match, route=rest_action(grpc.route))
    for key, config in grpc.typed_per_filter_config.items():  # rate limit, Lua off
        item.typed_per_filter_config[key].CopyFrom(config)
    item.request_headers_to_add.extend(grpc.request_headers_to_add)  # the fallback header
    item.metadata.CopyFrom(grpc.metadata)  # the model, for the tenant rate limit
    return item


def rest_routes(grpc_routes: Iterable[rc_pb2.Route], to_servers: rc_pb2.RouteAction) -> list[Any]:
    """The REST routes, to go before every gRPC route (they only match ``/v2`` paths).

    From each unary model route (``x-model-name: M`` [+ ``x-model-version: V``]): for a version
    route, ``/v2/models/M/versions/V[/...]`` and ``/v2/models/M[/...]`` with the header; for
    the model route, ``/v2/models/M[/...]``. Path versions first, then header versions, then
    models; then the server-level paths.
    """
    by_path, by_header, by_model = [], [], []
    for grpc in grpc_routes:
        model = _header_value(grpc.match, MODEL_HEADER)
        if model is None or not grpc.HasField("route") or grpc.match.path:  # streams: no REST
            continue
        base = f"{MODELS_PATH}/{model}"
        version = _header_value(grpc.match, VERSION_HEADER)
        if version is None:
            match = rc_pb2.RouteMatch(path_separated_prefix=base)
            # A lane's own headers (x-sla-class, a size range) select it over REST too.
            match.headers.extend(h for h in grpc.match.headers if h.name != MODEL_HEADER)
            by_model.append(_derived(f"rest:{grpc.name}", match, grpc))
            continue
        path = rc_pb2.RouteMatch(path_separated_prefix=f"{base}/versions/{version}")
        by_path.append(_derived(f"rest:{grpc.name}:path", path, grpc))
        header = rc_pb2.RouteMatch(path_separated_prefix=base)
        header.headers.append(_version_header(version))
        by_header.append(_derived(f"rest:{grpc.name}:header", header, grpc))
    servers = rest_action(to_servers)
    not_found = rc_pb2.DirectResponseAction(status=404)
    not_found.body.inline_string = REST_NOT_FOUND_MESSAGE  # made JSON by local_reply_config
    server_routes = [
        rc_pb2.Route(
            name="rest:server:stats", match=rc_pb2.RouteMatch(path=f"{MODELS_PATH}/stats"),
            route=servers,
        ),
        rc_pb2.Route(
            name="rest:model-not-found",
            match=rc_pb2.RouteMatch(prefix=f"{MODELS_PATH}/"),
            direct_response=not_found,
        ),
        rc_pb2.Route(
            name="rest:server", match=rc_pb2.RouteMatch(path_separated_prefix=REST_ROOT),
            route=servers,
        ),
    ]  # fmt: skip
    return by_path + by_header + by_model + [_lua_off(r) for r in server_routes]


_NON_EMPTY = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=".+"))


def preflight_route(to_servers: rc_pb2.RouteAction) -> rc_pb2.Route:
    """CORS preflights (OPTIONS with Origin and Access-Control-Request-Method), first: Envoy's
    CORS filter answers them only on a route with an action (not on the direct responses a
    header-less gRPC call first matches) and, as ``forward_not_matching_preflights`` is off,
    never forwards one, so the action's cluster is never used."""
    headers = [
        rc_pb2.HeaderMatcher(
            name=":method", string_match=string_pb2.StringMatcher(exact="OPTIONS")
        ),
        # Non-empty: Envoy's CORS filter answers a preflight only when both are, and lets one
        # with an empty value through to the route, which skips authentication.
        rc_pb2.HeaderMatcher(name="origin", string_match=_NON_EMPTY),
        rc_pb2.HeaderMatcher(name="access-control-request-method", string_match=_NON_EMPTY),
    ]
    match = rc_pb2.RouteMatch(prefix="/", headers=headers)
    return _lua_off(rc_pb2.Route(name="cors-preflight", match=match, route=to_servers))


def _version_header(version: str) -> rc_pb2.HeaderMatcher:
    return rc_pb2.HeaderMatcher(
        name=VERSION_HEADER, string_match=string_pb2.StringMatcher(exact=version)
    )


# --- listener -------------------------------------------------------------------------------


def grpc_web_filter() -> hcm_pb2.HttpFilter:
    """Before the Lua filter, which then reads plain gRPC framing (text mode decoded)."""
    return hcm_pb2.HttpFilter(name=GRPC_WEB_FILTER, typed_config=packed(grpc_web_pb2.GrpcWeb()))


def cors_filter() -> hcm_pb2.HttpFilter:
    """After the Lua filter: a header-less call's first route is a direct response, on which
    Envoy's CORS filter does nothing; after Lua it sees the model's route."""
    return hcm_pb2.HttpFilter(name=CORS_FILTER, typed_config=packed(cors_pb2.Cors()))


def json_error(message: str = "%LOCAL_REPLY_BODY%") -> Any:
    """A local reply body ``{"error": message}``."""
    fmt = substitution_format_string_pb2.SubstitutionFormatString()
    fmt.json_format.update({"error": message})
    return fmt


def status_filter(status: int) -> accesslog_pb2.AccessLogFilter:
    """A reply with HTTP status ``status``."""
    code = accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(
            op=accesslog_pb2.ComparisonFilter.EQ,
            value=_runtime_uint(status),
        )
    )
    return accesslog_pb2.AccessLogFilter(status_code_filter=code)


def all_of(filters: list[accesslog_pb2.AccessLogFilter]) -> accesslog_pb2.AccessLogFilter:
    """A reply every one of ``filters`` matches."""
    return accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(filters=filters))


def rest_request(status: int | None = None) -> accesslog_pb2.AccessLogFilter:
    """A reply to a REST request (a ``/v2`` path), with HTTP status ``status`` if given."""
    path = rc_pb2.HeaderMatcher(
        name=":path", string_match=string_pb2.StringMatcher(prefix=REST_ROOT)
    )
    on_path = accesslog_pb2.AccessLogFilter(header_filter=accesslog_pb2.HeaderFilter(header=path))
    if status is None:
        return on_path
    return all_of([on_path, status_filter(status)])


def _runtime_uint(value: int) -> Any:
    return base_pb2.RuntimeUInt32(default_value=value, runtime_key="infermesh_unused")


def rest_reply_mappers() -> list[hcm_pb2.ResponseMapper]:
    """Envoy's own replies to REST requests as ``{"error": ...}`` JSON (status unchanged)."""
    limited = hcm_pb2.ResponseMapper(
        filter=rest_request(429), body_format_override=json_error(RATE_LIMITED_MESSAGE)
    )
    other = hcm_pb2.ResponseMapper(filter=rest_request(), body_format_override=json_error())
    return [limited, other]


def grpc_rate_limited_mapper() -> hcm_pb2.ResponseMapper:
    """The gRPC message of a rate-limited call (Envoy's own is "local_rate_limited")."""
    text = substitution_format_string_pb2.SubstitutionFormatString()
    text.text_format_source.inline_string = RATE_LIMITED_MESSAGE
    return hcm_pb2.ResponseMapper(filter=status_filter(429), body_format_override=text)


def cors_policy(options: CorsOptions) -> Any:
    """The virtual host's CORS policy (typed_per_filter_config of the CORS filter)."""
    origins = [
        string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=".*"))
        if origin == "*"
        else string_pb2.StringMatcher(exact=origin)
        for origin in options.allow_origins
    ]
    policy = cors_pb2.CorsPolicy(
        allow_origin_string_match=origins,
        allow_methods=CORS_METHODS,
        allow_headers=",".join(options.allow_headers),
        expose_headers=",".join(options.expose_headers),
        max_age=str(options.max_age_s),
    )
    policy.forward_not_matching_preflights.value = False
    return packed(policy)


# --- topology -------------------------------------------------------------------------------

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name
_ORIGIN = re.compile(r"\*|[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#]+")  # "*" or scheme://host[:port]
_REST = ("enabled", "port_offset")
_CORS = ("allow_origins", "allow_headers", "expose_headers", "max_age_s")


def parse_rest(c: Checker, value: object, path: str) -> RestOptions:
    default = RestOptions()
    if value is None:
        return default
    m = c.mapping(value, path) or {}
    c.keys(m, path, _REST)
    enabled = c.value(m, path, "enabled", "bool", default.enabled)
    offset = m.get("port_offset", default.port_offset)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 < abs(offset) < MAX_PORT:
        c.fail(
            f"{path}.port_offset",
            f"must be a non-zero integer in -{MAX_PORT - 1}..{MAX_PORT - 1}",
            offset,
        )
        offset = default.port_offset
    return RestOptions(enabled, offset)


def _strings(c: Checker, m: dict[str, Any], path: str, key: str, pattern: re.Pattern[str],
             what: str, default: tuple[str, ...]) -> tuple[str, ...]:  # fmt: skip
    if key not in m:
        return default
    items = c.sequence(m[key], f"{path}.{key}")
    if items is None:
        return default
    result = []
    for index, item in enumerate(items):
        if isinstance(item, str) and pattern.fullmatch(item):
            result.append(item.lower() if key != "allow_origins" else item)
        else:
            c.fail(f"{path}.{key}[{index}]", f"must be {what}", item)
    return tuple(dict.fromkeys(result))


def parse_cors(c: Checker, value: object, path: str) -> CorsOptions | None:
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, _CORS, required=("allow_origins",))
    origins = _strings(c, m, path, "allow_origins", _ORIGIN,
                       'an origin like "https://app.example.com" or "*"', ())  # fmt: skip
    if "allow_origins" in m and isinstance(m["allow_origins"], list) and not m["allow_origins"]:
        c.fail(f"{path}.allow_origins", "must list at least one origin", [])
    default = CorsOptions(allow_origins=())
    allow = _strings(c, m, path, "allow_headers", _TOKEN, "a header name", default.allow_headers)
    expose = _strings(c, m, path, "expose_headers", _TOKEN, "a header name",
                      default.expose_headers)  # fmt: skip
    max_age = m.get("max_age_s", default.max_age_s)
    if not isinstance(max_age, int) or isinstance(max_age, bool) or max_age < 0:
        c.fail(f"{path}.max_age_s", "must be an integer >= 0", max_age)
        max_age = default.max_age_s
    return CorsOptions(origins, allow, expose, max_age)


def check_rest_ports(c: Checker, rest: RestOptions, ports: Iterable[tuple[str, int]]) -> None:
    """Static endpoints ((path, port), those without a rest_port of their own) whose REST port
    would not be a port are errors."""
    if not rest.enabled:
        return
    for where, port in ports:
        if not 1 <= port + rest.port_offset <= MAX_PORT:
            c.errors.append(
                f"{where}: REST port {port} + listener.rest.port_offset {rest.port_offset} "
                f"= {port + rest.port_offset} is not a port in 1..{MAX_PORT} "
                "(change the offset or set listener.rest.enabled: false)"
            )
