"""Turns a ``MeshState`` into Envoy xDS resources (listener, routes, clusters, endpoints).

``build_resources`` returns ``{type_url: {resource_name: message}}`` built directly from the
xds-protos message classes, ready for a SotW or delta ADS server. Everything here is pure.

Routing: the model's cluster is chosen by the ``x-model-name`` (and ``x-model-version``)
request headers. Clients that do not send them (stock tritonclient) are routed by a Lua filter
that copies ``model_name``/``model_version`` from the body of unary calls into those headers.

Why it is one module of this length: the listener and the route table are built together (each
route names filters and clusters the listener and clusters must match); the policies it applies
are in their own modules (edge, identity, exposure, protection, upstream_tls).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    base_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import range_pb2
from google.protobuf.message import Message
from google.protobuf.wrappers_pb2 import UInt32Value

from control_plane.model.lanes import (
    INPUT_BYTES_HEADER,
    MAX_INT64,
    SLA_CLASS_HEADER,
    large_cluster,
    sla_cluster,
)
from control_plane.model.mesh import (
    LISTENER_NAME,
    NO_PODS,
    ROUTE_CONFIG_NAME,
    SERVERS_CLUSTER,
    Affinity,
    EdgeAuth,
    MeshState,
    ModelRoute,
    SlaClass,
    base_cluster,
    cluster_model,
    fallback_cluster,
    is_rest_cluster,
    model_cluster,
    rest_cluster,
)
from control_plane.xds import (
    affinity,
    edge,
    edge_limits,
    edge_tls,
    exposure,
    identity,
    openai_edge,
    token_admission,
    upstream_tls,
)
from control_plane.xds.clusters import (
    build_assignment,
    build_cluster,
    retry_budget_percent,
    socket_address,
)
from control_plane.xds.envoy_values import ads_source, duration, packed, set_header
from control_plane.xds.lua_routing import LUA_FILTER, lua_source
from control_plane.xds.protection import (
    RATE_LIMIT_FILTER,
    aggregate_cluster,
    rate_limit_filter,
    route_rate_limit,
)
from control_plane.xds.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    SECRET_TYPE,
)
from infermesh.wire import FALLBACK_HEADER, MODEL_HEADER, VERSION_HEADER

HCM_FILTER = "envoy.filters.network.http_connection_manager"
ROUTER_FILTER = "envoy.filters.http.router"
GRPC_SERVICE = "/inference.GRPCInferenceService/"
# Calls that are not about one model: any server can answer them.
SERVER_METHODS = ("ServerLive", "ServerReady", "ServerMetadata", "RepositoryIndex")
SERVER_PATHS = (*(GRPC_SERVICE + m for m in SERVER_METHODS), "/grpc.health.v1.Health/")
STREAM_PATH = GRPC_SERVICE + "ModelStreamInfer"
HEALTH_WATCH_PATH = "/grpc.health.v1.Health/Watch"
RETRY_ON = "unavailable,reset,connect-failure,refused-stream"
# For a model declared idempotent: false: a reset may come after the server ran the request.
RETRY_ON_NOT_IDEMPOTENT = "unavailable,connect-failure,refused-stream"
NOT_FOUND_MESSAGE = "model not found in the mesh"
STREAM_NEEDS_HEADER = f"ModelStreamInfer needs the {MODEL_HEADER} request header"
NO_MODEL_MESSAGE = f"no model name in the request: set the {MODEL_HEADER} request header"
GRPC_NOT_FOUND = 5
GRPC_INVALID_ARGUMENT = 3
# Largest header-less request the Lua filter can buffer: the model servers' default request cap
# (64 MiB of tensors) plus their 16 MiB gRPC headroom.
BODY_BUFFER_LIMIT_BYTES = 80 * 1024 * 1024

NO_AUTH = EdgeAuth()  # auth "off": unit tests' and benches' meshes built without a topology

# --- listener -------------------------------------------------------------------------------


def http_filters(
    body_routing: bool,
    rate_limits: bool = False,
    grpc_web: bool = False,
    cors: bool = False,
    expose: tuple[str, ...] = exposure.DEFAULT_EXPOSE,
    auth: EdgeAuth = NO_AUTH,
    models: tuple[str, ...] = (),
    affinities: tuple[tuple[str, Affinity], ...] = (),
) -> list[hcm_pb2.HttpFilter]:
    """RBAC (only the exposed APIs, before anything reads a body), [gRPC-Web, so Lua reads
    gRPC], [authentication (Bearer keys made Basic first): before Lua buffers a body], [Lua
    body routing: gRPC, then /v1 JSON], [the tenants' rules, CORS, the rate limits: after Lua
    so they see the model and the re-selected route], router."""
    filters = [exposure.rbac_filter(expose)]
    if grpc_web:
        filters.append(edge.grpc_web_filter())
    if auth.mode == "api_keys":  # the OpenAI client's "Bearer KEY", for basic_auth
        filters.append(openai_edge.bearer_filter())
    filters += identity.authentication_filters(auth)
    # /v1 bodies' "model", on its entry routes only, before the affinity key; and GET
    # /v1/models narrowed to what a tenant limited to some models may use, body routing or not
    if body_routing or openai_edge.visible_models(auth):
        filters.append(openai_edge.router_filter(auth))
    if body_routing or affinities:
        source = base_pb2.DataSource(inline_string=lua_source(affinities))
        lua = lua_pb2.Lua(default_source_code=source)
        filters.append(hcm_pb2.HttpFilter(name=LUA_FILTER, typed_config=packed(lua)))
    filters += identity.tenant_rules(auth)
    if cors:
        filters.append(edge.cors_filter())
    # The tenant's bucket first: a tenant over its own limit does not spend the model's.
    filters += identity.tenant_rate_limit_filter(auth, models)
    if rate_limits:
        filters.append(rate_limit_filter())
    # Last before the router: a request the cheaper limits refuse reserves no tokens.
    filters += token_admission.token_filters(auth)
    filters.append(hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=packed(router_pb2.Router())))
    return filters


# One JSON object per request: what an operator (or a benchmark) needs to tell answers apart,
# since gRPC errors are HTTP 200 and only the trailers say what happened.
ACCESS_LOG_FIELDS = {
    "start": "%START_TIME%",
    "path": "%REQ(:PATH)%",
    "model": "%REQ(X-MODEL-NAME)%",
    "grpc_status": "%GRPC_STATUS_NUMBER%",
    "http_status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "duration_ms": "%DURATION%",
    "upstream": "%UPSTREAM_HOST%",
    "cluster": "%UPSTREAM_CLUSTER%",
    # the key an affinity model was hashed on (control_plane.xds.affinity), its first 80 chars
    "affinity": "%REQ(X-INFERMESH-AFFINITY):80%",
}


def access_log(path: str, auth: EdgeAuth = NO_AUTH) -> accesslog_pb2.AccessLog:
    fmt = substitution_format_string_pb2.SubstitutionFormatString()
    fmt.json_format.update({**ACCESS_LOG_FIELDS, **identity.access_log_fields(auth)})
    config = file_pb2.FileAccessLog(path=path, log_format=fmt)
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.file", typed_config=packed(config))


def affinities(state: MeshState) -> tuple[tuple[str, Affinity], ...]:
    """(model, affinity) of the models with affinity: the Lua script's table."""
    return tuple((m.name, m.affinity) for m in state.models if m.affinity is not None)


def build_listener(state: MeshState) -> listener_pb2.Listener:
    options = state.listener
    keyed = affinities(state)
    manager = hcm_pb2.HttpConnectionManager(
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        stat_prefix=LISTENER_NAME,
        rds=hcm_pb2.Rds(route_config_name=ROUTE_CONFIG_NAME, config_source=ads_source()),
        http_filters=http_filters(
            options.body_routing, any(m.rate_limit for m in state.models), options.grpc_web,
            options.cors is not None, options.expose, options.auth,
            tuple(m.name for m in state.models), keyed,
        ),
    )  # fmt: skip
    exposure.harden(manager)
    edge_limits.apply(manager, options.limits)
    if options.rest.enabled:  # first: Envoy's own replies under /v1 are OpenAI's error JSON
        manager.local_reply_config.mappers.extend(
            token_admission.openai_refusal_mappers(options.auth)
        )
        manager.local_reply_config.mappers.extend(
            openai_edge.reply_mappers(
                options.expose, identity.PERMISSION_MESSAGE, edge.RATE_LIMITED_MESSAGE
            )
        )
    manager.local_reply_config.mappers.extend(exposure.refusal_mappers(options.expose))
    manager.local_reply_config.mappers.extend(identity.refusal_mappers(options.auth))
    manager.local_reply_config.mappers.extend(token_admission.refusal_mappers(options.auth))
    if options.rest.enabled:
        manager.local_reply_config.mappers.extend(edge.rest_reply_mappers())
    manager.local_reply_config.mappers.append(edge.grpc_rate_limited_mapper())
    if options.body_routing or keyed:
        # On HTTP/2 the stream window bounds a body a filter buffers (16 MiB by default, then
        # 413 "Payload Too Large"): lift it to what the model servers accept.
        window = manager.http2_protocol_options.initial_stream_window_size
        window.value = BODY_BUFFER_LIMIT_BYTES
    if options.access_log:
        manager.access_log.append(access_log(options.access_log, options.auth))
    hcm = listener_components_pb2.Filter(name=HCM_FILTER, typed_config=packed(manager))
    listener = listener_pb2.Listener(
        name=LISTENER_NAME,
        address=socket_address(options.host, options.port),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[*edge_limits.connection_filters(options.limits), hcm],
                transport_socket=edge_tls.transport_socket() if options.tls else None,
            )
        ],
    )
    listener.per_connection_buffer_limit_bytes.value = edge_limits.buffer_limit_bytes(
        options.limits
    )
    return listener


# --- routes ---------------------------------------------------------------------------------


def exact_header(name: str, value: str) -> rc_pb2.HeaderMatcher:
    return rc_pb2.HeaderMatcher(name=name, string_match=string_pb2.StringMatcher(exact=value))


def model_match(model: str, version: str | None = None) -> rc_pb2.RouteMatch:
    headers = [exact_header(MODEL_HEADER, model)]
    if version is not None:
        headers.append(exact_header(VERSION_HEADER, version))
    return rc_pb2.RouteMatch(prefix="/", headers=headers)


def route(
    name: str, match: rc_pb2.RouteMatch, *, lua: bool = False, **fields: object
) -> rc_pb2.Route:
    """A route; the Lua filter is off on it unless ``lua`` (it only helps header-less calls)."""
    result = rc_pb2.Route(name=name, match=match, **fields)
    if not lua:
        result.typed_per_filter_config[LUA_FILTER].Pack(lua_pb2.LuaPerRoute(disabled=True))
    return result


def grpc_error(
    name: str, match: rc_pb2.RouteMatch, status: int, message: str, *, lua: bool = False
) -> rc_pb2.Route:
    """A trailers-only gRPC error: HTTP 200 and headers only, grpc-status and grpc-message."""
    headers = {
        "content-type": "application/grpc",
        "grpc-status": str(status),
        "grpc-message": message,
    }
    add = [set_header(key, value) for key, value in headers.items()]
    response = rc_pb2.DirectResponseAction(status=200)
    return route(name, match, lua=lua, direct_response=response, response_headers_to_add=add)


HEDGE_BACK_OFF_S = 0.001  # Envoy's least retry back-off base interval


def retry_policy(
    state: MeshState,
    timeout_s: float | None = None,
    retries: int | None = None,
    idempotent: bool = True,
) -> rc_pb2.RetryPolicy:
    """Retries on other hosts (previous_hosts) for failures a model server did not cause;
    ``retries`` None: the listener's max_retries. Not ``idempotent``: never on a reset."""
    predicate = rc_pb2.RetryPolicy.RetryHostPredicate(
        name="envoy.retry_host_predicates.previous_hosts",
        typed_config=packed(previous_hosts_pb2.PreviousHostsPredicate()),
    )
    policy = rc_pb2.RetryPolicy(
        retry_on=RETRY_ON if idempotent else RETRY_ON_NOT_IDEMPOTENT,
        num_retries=UInt32Value(value=state.listener.max_retries if retries is None else retries),
        retry_host_predicate=[predicate],
        host_selection_retry_max_attempts=3,
    )
    if timeout_s is not None:
        policy.per_try_timeout.CopyFrom(duration(timeout_s))
    return policy


def split_weights(model: ModelRoute) -> list[tuple[str, int]]:
    """(cluster, weight) pairs of a model's version split; empty when there is no split."""
    return [(model_cluster(model.name, v), w) for v, w in model.version_split if w > 0]


def model_action(
    state: MeshState,
    model: ModelRoute,
    cluster: str | None = None,
    sla: SlaClass | None = None,
    hedge: bool = True,
) -> rc_pb2.RouteAction:
    """Timeout and retries of ``model`` (of its SLA class ``sla`` if given); to ``cluster`` if
    given, else by its version split. ``hedge``: False for requests the pool's P99 does not
    describe (large inputs take longer by design: a hedge would only run them twice)."""
    timeout = model.timeout_s if sla is None else sla.timeout_s
    own_per_try = None if sla is None else sla.per_try_timeout_s  # the class's: cancel, retry
    from_p99 = model.hedge_per_try_s if model.hedging is not None and hedge else None
    hedged = hedge and own_per_try is None and (from_p99 is not None or model.stalled_try_share > 0)
    if own_per_try is not None:
        per_try = own_per_try
    elif from_p99 is not None:  # routing.hedging: from the pool's P99
        per_try = min(from_p99, timeout)
    elif hedged:  # the stalled-try share
        per_try = model.stalled_try_share * timeout
    else:
        per_try = timeout
    action = rc_pb2.RouteAction(
        timeout=duration(timeout),
        retry_policy=retry_policy(
            state, per_try, None if sla is None else sla.max_retries, model.idempotent
        ),
    )
    if hedged:  # a try past its per-try timeout races another host, and is not cancelled
        action.hedge_policy.hedge_on_per_try_timeout = True
        # Envoy delays a hedge by its retry back-off like any retry: 0-24 ms for the first,
        # 0-74 and 0-174 ms after, by default. A hedge is due at the per-try timeout, so the
        # back-off is Envoy's least (1 ms, at most 10 ms); the retry budget bounds the load.
        action.retry_policy.retry_back_off.base_interval.CopyFrom(duration(HEDGE_BACK_OFF_S))
    if model.affinity is not None:  # Maglev on the key the edge's Lua sets
        affinity.hash_policy(action)
    weights = [] if cluster else split_weights(model)
    versions = [v for v, w in model.version_split if w > 0]  # the same order as split_weights
    target = cluster or model_cluster(model.name)
    if model.fallback is not None and model.fallback_active:  # the circuit is open
        action.cluster = model_cluster(model.fallback)
        return action
    if model.fallback is not None:  # each target through its aggregate with the fallback
        weights = [(fallback_cluster(name), weight) for name, weight in weights]
        target = fallback_cluster(target)
    for (name, weight), version in zip(weights, versions, strict=False):
        entry = action.weighted_clusters.clusters.add(name=name, weight=UInt32Value(value=weight))
        # The server picks the version from the body; a request that names none is told here
        # which version its share of the split went to.
        header = entry.request_headers_to_add.add()
        header.header.key, header.header.value = VERSION_HEADER, version
        header.append_action = header.ADD_IF_ABSENT
    if not weights:
        action.cluster = target
    return action


def model_routes(
    name: str, match: rc_pb2.RouteMatch, action: rc_pb2.RouteAction, model: ModelRoute
) -> list[rc_pb2.Route]:
    """A model's (or version's) stream route, then its route for everything else.

    ModelStreamInfer may run as long as a generation does: no overall timeout, but an idle
    timeout of the model's timeout between messages, and no retries (a stream's messages are
    not replayed). Envoy passes stream messages through unbuffered.
    """
    stream_match = rc_pb2.RouteMatch()
    stream_match.CopyFrom(match)
    stream_match.ClearField("prefix")
    stream_match.path = STREAM_PATH
    lua = model.affinity is not None  # the Lua filter sets the affinity key
    stream = route(f"{name}:stream", stream_match, lua=lua, route=stream_action(action, model))
    unary = route(name, match, lua=lua, route=action)
    return [protect(stream, model), protect(unary, model)]


def stream_action(action: rc_pb2.RouteAction, model: ModelRoute) -> rc_pb2.RouteAction:
    """``action`` for a stream (ModelStreamInfer, a streamed OpenAI completion): no overall
    timeout, an idle timeout of the model's timeout, no retries and no hedging (a stream's
    messages are not replayed), exempt from the listener's unary stream duration."""
    result = rc_pb2.RouteAction()
    result.CopyFrom(action)
    result.ClearField("retry_policy")
    result.ClearField("hedge_policy")
    result.timeout.CopyFrom(duration(0))
    result.idle_timeout.CopyFrom(duration(model.timeout_s))
    edge_limits.exempt_stream(result)
    return result


def protect(item: rc_pb2.Route, model: ModelRoute) -> rc_pb2.Route:
    """Adds the model's name (route metadata), rate limit and fallback header to one of its
    routes."""
    identity.mark_model(item, model.name)
    if model.rate_limit is not None:
        item.typed_per_filter_config[RATE_LIMIT_FILTER].CopyFrom(
            route_rate_limit(model.name, model.rate_limit)
        )
    if model.fallback is not None:
        item.request_headers_to_add.append(set_header(FALLBACK_HEADER, model.fallback))
    return item


def cluster_versions(state: MeshState, model: str) -> list[str]:
    """Versions of ``model`` that have their own cluster, numeric ones in numeric order."""
    prefix = model_cluster(model, "")
    model_clusters = {model_cluster(m.name) for m in state.models}  # "model:a:vx" is a model
    found = [
        name.removeprefix(prefix)
        for name in state.clusters
        if name.startswith(prefix) and name != prefix and name not in model_clusters
    ]
    return sorted(found, key=lambda v: (not v.isdigit(), v.zfill(20) if v.isdigit() else v))


def build_route_config(state: MeshState) -> route_pb2.RouteConfiguration:
    to_servers = rc_pb2.RouteAction(cluster=SERVERS_CLUSTER, retry_policy=retry_policy(state))
    # Health/Watch is a stream that answers on every change, for as long as the client keeps
    # it: not the unary 15 s route timeout nor the listener's unary stream duration (both cut
    # it), not retried; the listener's idle timeout still ends one left silent.
    watch = rc_pb2.RouteAction(cluster=SERVERS_CLUSTER)
    watch.timeout.CopyFrom(duration(0))
    edge_limits.exempt_stream(watch)
    routes = [route("server:health-watch", rc_pb2.RouteMatch(path=HEALTH_WATCH_PATH), route=watch)]
    routes += [
        route(f"server:{p}", rc_pb2.RouteMatch(prefix=p), route=to_servers) for p in SERVER_PATHS
    ]
    for model in state.models:
        for version in cluster_versions(state, model.name):
            cluster = model_cluster(model.name, version)
            action = model_action(state, model, cluster)
            routes += model_routes(cluster, model_match(model.name, version), action, model)
    for model in state.models:
        routes += lane_routes(state, model)
        action = model_action(state, model)
        routes += model_routes(model_cluster(model.name), model_match(model.name), action, model)
    has_header = rc_pb2.HeaderMatcher(name=MODEL_HEADER, present_match=True)
    routes += [
        grpc_error(
            "model-not-found",
            rc_pb2.RouteMatch(prefix="/", headers=[has_header]),
            GRPC_NOT_FOUND,
            NOT_FOUND_MESSAGE,
        ),
        grpc_error(
            "stream-without-model",
            rc_pb2.RouteMatch(path=STREAM_PATH),
            GRPC_INVALID_ARGUMENT,
            STREAM_NEEDS_HEADER,
        ),
        # The one route the Lua filter runs on: it may add the header and re-route the call.
        grpc_error(
            "no-model-name",
            rc_pb2.RouteMatch(prefix="/"),
            GRPC_INVALID_ARGUMENT,
            NO_MODEL_MESSAGE,
            lua=True,
        ),
    ]
    if state.listener.rest.enabled:  # /v2 paths only: first, or x-model-name would take them
        routes = edge.rest_routes(routes, to_servers) + openai_routes(state, to_servers) + routes
    if state.listener.cors is not None:  # preflights need a route with an action, to any
        routes.insert(0, identity.unauthenticated(edge.preflight_route(to_servers)))
    if state.listener.auth.token_limited:  # a model nobody's tokens are limited on skips them
        for item in routes:
            token_admission.skip_unlimited(item, state.listener.auth)
    if not state.listener.body_routing and not affinities(state):
        for item in routes:
            item.typed_per_filter_config.pop(LUA_FILTER, None)  # no Lua filter to configure
            if item.name != openai_edge.MODELS_ROUTE:  # its list is narrowed all the same
                item.typed_per_filter_config.pop(openai_edge.OPENAI_LUA_FILTER, None)
    elif not state.listener.body_routing:  # the Lua filter is there for affinity only
        for item in routes:
            if item.name != openai_edge.MODELS_ROUTE:
                item.typed_per_filter_config.pop(openai_edge.OPENAI_LUA_FILTER, None)
            if item.name == "no-model-name":
                item.typed_per_filter_config[LUA_FILTER].Pack(lua_pb2.LuaPerRoute(disabled=True))
    host = rc_pb2.VirtualHost(name=LISTENER_NAME, domains=["*"], routes=routes)
    added, removed = identity.upstream_headers(state.listener.auth)
    host.request_headers_to_add.extend(added)
    host.request_headers_to_remove.extend(removed)
    if state.listener.cors is not None:
        host.typed_per_filter_config[edge.CORS_FILTER].CopyFrom(
            edge.cors_policy(state.listener.cors)
        )
    return route_pb2.RouteConfiguration(name=ROUTE_CONFIG_NAME, virtual_hosts=[host])


def openai_routes(state: MeshState, to_servers: rc_pb2.RouteAction) -> list[rc_pb2.Route]:
    """The OpenAI API's routes (``/v1`` paths only): each model's, to its REST twins as a
    stream, with its version split, fallback, rate limit and name; then the entry routes."""
    routes = []
    for model in state.models:
        action = stream_action(edge.rest_action(model_action(state, model)), model)
        lua = model.affinity is not None  # the Lua filter sets the affinity key from the body
        routes += [protect(r, model) for r in openai_edge.model_routes(model.name, action, lua)]
    return routes + openai_edge.entry_routes(edge.rest_action(to_servers), state.listener.auth)


def lane_routes(state: MeshState, model: ModelRoute) -> list[rc_pb2.Route]:
    """A model's SLA-class routes (``x-sla-class: C``; any other value is an error naming the
    classes), then its large-input routes (declared size, or content-length, >= min_bytes)."""
    routes = []
    for sla in model.sla_classes:
        match = model_match(model.name)
        match.headers.append(exact_header(SLA_CLASS_HEADER, sla.name))
        cluster = sla_cluster(model.name, sla.name)
        routes += model_routes(cluster, match, model_action(state, model, cluster, sla), model)
    if model.sla_classes:
        unknown = model_match(model.name)
        unknown.headers.append(rc_pb2.HeaderMatcher(name=SLA_CLASS_HEADER, present_match=True))
        known = ", ".join(c.name for c in model.sla_classes)
        message = f"{SLA_CLASS_HEADER}: unknown class for model {model.name}, expected {known}"
        routes.append(grpc_error(f"{model_cluster(model.name)}:sla-unknown", unknown,
                                 GRPC_INVALID_ARGUMENT, message))  # fmt: skip
    if model.large_inputs is not None:
        cluster = large_cluster(model.name)
        action = model_action(state, model, cluster, hedge=False)
        at_least = range_pb2.Int64Range(start=model.large_inputs.min_bytes, end=MAX_INT64)
        for header in (INPUT_BYTES_HEADER, "content-length"):
            match = model_match(model.name)
            match.headers.append(rc_pb2.HeaderMatcher(name=header, range_match=at_least))
            routes += model_routes(f"{cluster}:{header}", match, action, model)
    return routes


def route_clusters(route_config: route_pb2.RouteConfiguration) -> set[str]:
    """Every cluster a route configuration names."""
    names: set[str] = set()
    for host in route_config.virtual_hosts:
        for item in host.routes:
            names.update(c.name for c in item.route.weighted_clusters.clusters)
            if item.route.cluster:
                names.add(item.route.cluster)
    return names


# How a resource is made: (type URL, name, key, make) -> the message. ``key`` holds everything
# ``make`` reads, so a caller may hand back the message it made for an equal key before
# (``control_plane.xds.incremental``); the default makes every one afresh.
Make = Callable[[str, str, Hashable, Callable[[], Message]], Message]


def fresh(type_url: str, name: str, key: Hashable, make: Callable[[], Message]) -> Message:
    return make()


def build_resources(state: MeshState, made: Make = fresh) -> dict[str, dict[str, Message]]:
    """All xDS resources for ``state``, keyed by type URL, then by resource name.

    A cluster that a route names but ``state.clusters`` lacks is added with no endpoints, so
    that Envoy answers "no healthy upstream" (UNAVAILABLE) rather than "cluster not found".
    Every resource is made through ``made`` with a key of its inputs: the route configuration
    reads the listener options, the models and the cluster names; a cluster its options and
    its model's circuit breaker; an assignment its members.
    """
    route_key = (state.listener, state.models, tuple(state.clusters))
    route_config = made(ROUTE_TYPE, ROUTE_CONFIG_NAME, route_key, lambda: build_route_config(state))
    assert isinstance(route_config, route_pb2.RouteConfiguration)
    named_clusters = route_clusters(route_config)
    fallbacks = fallback_members(state, named_clusters)
    members = dict(state.clusters)
    if state.listener.rest.enabled:  # every cluster's twin shares its tuple of assignments
        members.update({rest_cluster(name): items for name, items in state.clusters.items()})
    named = {c for c in named_clusters if c not in fallbacks}
    for name in named | {c for pair in fallbacks.values() for c in pair}:
        members.setdefault(name, state.clusters.get(base_cluster(name), ()))  # a REST twin's
    names = sorted(members)
    primaries = {pair[0] for pair in fallbacks.values()}
    models = {m.name: m for m in state.models}

    def cluster(name: str) -> Message:
        model = models.get(cluster_model(name) or "")  # a cluster reads its circuit breaker
        breaker = model.circuit_breaker if model else None
        key = ("eds", state.listener, breaker, is_rest_cluster(name),
               model.affinity if model else None)  # fmt: skip
        return made(CLUSTER_TYPE, name, key, lambda: build_cluster(state, name))

    def aggregate(name: str, pair: tuple[str, str]) -> Message:
        model = models.get(cluster_model(pair[0]) or "")
        budget = retry_budget_percent(state.listener, model)
        return made(CLUSTER_TYPE, name, ("aggregate", pair, budget),
                    lambda: aggregate_cluster(name, list(pair), budget))  # fmt: skip

    rest_ports = dict(state.rest_ports)
    tls = state.listener.upstream_tls
    trust_domain = tls.trust_domain if tls is not None else ""
    plaintext = tls.plaintext if tls is not None else frozenset()
    pods = tls.pods if tls is not None else NO_PODS

    def assignment(name: str) -> Message:
        # A REST twin shares the gRPC cluster's tuple (cheap to compare); ports shift here.
        twin = is_rest_cluster(name)
        offset = state.listener.rest.port_offset if twin else 0
        key = (members[name], name in primaries, offset, state.rest_ports if twin else (),
               trust_domain, plaintext, pods)  # fmt: skip
        return made(ENDPOINT_TYPE, name, key, lambda: build_assignment(
            name, edge.rest_assignments(members[name], offset, rest_ports) if twin
            else members[name], name in primaries, trust_domain, plaintext, pods))  # fmt: skip

    clusters = {name: cluster(name) for name in names}
    clusters.update({name: aggregate(name, pair) for name, pair in fallbacks.items()})
    listener_key = (
        state.listener,
        any(m.rate_limit for m in state.models),
        # The tenant rate limit has a bucket per tenant and model.
        tuple(m.name for m in state.models) if state.listener.auth.rate_limited else (),
        affinities(state),  # the Lua script's table
    )
    listener = made(LISTENER_TYPE, LISTENER_NAME, listener_key, lambda: build_listener(state))
    built = {
        LISTENER_TYPE: {LISTENER_NAME: listener},
        ROUTE_TYPE: {ROUTE_CONFIG_NAME: route_config},
        CLUSTER_TYPE: dict(sorted(clusters.items())),
        ENDPOINT_TYPE: {name: assignment(name) for name in names},
    }
    if tls is not None:  # the CA, for every node (each node's own identity: node_secrets)
        ca = made(
            SECRET_TYPE, upstream_tls.CA_SECRET, tls.ca_pem, lambda: upstream_tls.ca_secret(tls)
        )
        built[SECRET_TYPE] = {upstream_tls.CA_SECRET: ca}
    listener_tls = state.listener.tls
    if listener_tls is not None:  # the public listener's certificate, for every node
        certificate = made(
            SECRET_TYPE, edge_tls.EDGE_SECRET, listener_tls, lambda: edge_tls.secret(listener_tls)
        )
        built.setdefault(SECRET_TYPE, {})[edge_tls.EDGE_SECRET] = certificate
    return built


def fallback_members(state: MeshState, named: set[str]) -> dict[str, tuple[str, str]]:
    """Each fallback aggregate the routes name -> (its own cluster, the fallback's cluster)."""
    fallbacks = {}
    models = {m.name: m for m in state.models}  # (a scan per cluster: 80 ms at 10,000 endpoints)
    for name in named:
        primary = name.removeprefix(fallback_cluster(""))
        if primary == name:
            continue
        model = models.get(cluster_model(primary) or "")
        if model is not None and model.fallback is not None:
            other = model_cluster(model.fallback)
            fallbacks[name] = (primary, rest_cluster(other) if is_rest_cluster(name) else other)
    return fallbacks
