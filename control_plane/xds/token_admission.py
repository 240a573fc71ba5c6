"""Token limits at the edge: a Lua script that sizes each request, and Envoy's ratelimit filter
that reserves it with the control plane's token limiter and settles it when the stream ends.

The chain, after the tenants' rules and rate limits (``control_plane.xds.resources``):

1. ``infermesh.token_admission`` (Lua, a script of its own so the body-routing and affinity
   scripts merge apart): on an inference call it writes the request's **bound** into the
   dynamic metadata ``infermesh.tokens:reserve``: ``max_tokens`` (gRPC: the ModelInferRequest
   parameter; REST and OpenAI JSON: ``max_tokens`` / ``max_completion_tokens``, the largest
   found in the body's first 64 KiB (gRPC) or 1 MiB (JSON), a negative one read as 0;
   default 32, the model server's) plus the body's length,
   an upper bound of the prompt's tokens for the byte-level demo LM. Where it cannot know the
   bound (a chat without one, an escaped JSON key, a compressed body) it reserves the context
   (``STREAM_RESERVE``). A ModelStreamInfer stream
   is not buffered: it reserves ``STREAM_RESERVE`` (at most the limit's burst, ``kind``
   ``stream``) and settles the whole stream's usage when it closes. On the response it copies
   the model server's ``x-infermesh-tokens-used`` (header or trailer) into
   ``infermesh.tokens:used``.
2. ``infermesh.token_limit`` (Envoy's ratelimit filter, domain ``infermesh.tokens``, its own
   ``rate_limits``): before the request goes upstream, the descriptor (tenant label, model,
   ``reserve``, the script's reservation id) with ``hits_addend`` = the bound; when the stream ends
   (``apply_on_stream_done``), the same with ``settle`` and ``hits_addend`` = the tokens used.
   A descriptor whose metadata is absent is not sent: no bound, no call; no usage reported,
   no settlement (the reservation stays charged). A reply Envoy made itself, before any model
   server answered (no ``x-envoy-upstream-service-time``; on a stream, whose answers start
   before the request ends, a trailers-only answer), settles 0. The script is
   ``control_plane.xds.token_admission_lua``. A model's routes skip
   both filters when no tenant has a token limit on it (``skip_unlimited``). The service is
   ``control_plane.xds.token_limiter`` on ``token_limiter_cluster`` (the bootstrap's).

Over the limit: 429 (REST) / RESOURCE_EXHAUSTED (gRPC), ``retry-after``,
``x-infermesh-rate-limited: tokens`` and the limiter's message naming tenant, model and
tokens/min. The limiter unreachable (or slower than ``TIMEOUT_S``): refused with 503 /
UNAVAILABLE unless ``listener.auth.token_limiter: open``.
"""

from __future__ import annotations

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.config.core.v3 import substitution_format_string_pb2 as format_pb2
from envoy.config.ratelimit.v3 import rls_pb2 as rls_config_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import metadata_pb2, value_pb2
from envoy.type.v3 import http_status_pb2

from control_plane.model.mesh import OTHER_TENANT, EdgeAuth
from control_plane.xds import edge, openai_edge
from control_plane.xds.bootstrap import TOKEN_LIMITER_CLUSTER
from control_plane.xds.envoy_values import duration, packed
from control_plane.xds.identity import (
    LABEL_KEY,
    RBAC_NAMESPACE,
    ROUTE_NAMESPACE,
    TOKEN_ADMISSION_FILTER,
    TOKEN_LIMIT_FILTER,
    metadata_action,
)
from control_plane.xds.token_admission_lua import (
    RESERVATION_HEADER,
    TOKENS_NAMESPACE,
    lua_source,
)
from control_plane.xds.token_limiter import (
    DOMAIN,
    KIND_KEY,
    MESSAGE_KEY,
    MODEL_KEY,
    PHASE_KEY,
    REQUEST_KEY,
    RESERVE,
    SETTLE,
    TENANT_KEY,
    UNARY,
)

ADMISSION_FILTER = TOKEN_ADMISSION_FILTER
LIMIT_FILTER = TOKEN_LIMIT_FILTER
RATELIMIT_NAMESPACE = "envoy.filters.http.ratelimit"  # where the filter puts the service's metadata
TIMEOUT_S = 1.0


def _generic(key: str, value: str) -> rc_pb2.RateLimit.Action:
    return rc_pb2.RateLimit.Action(
        generic_key=rc_pb2.RateLimit.Action.GenericKey(descriptor_key=key, descriptor_value=value)
    )


def _policy(phase: str, hits_key: str) -> rc_pb2.RateLimit:
    source = rc_pb2.RateLimit.Action.MetaData
    actions = [
        metadata_action(TENANT_KEY, RBAC_NAMESPACE, LABEL_KEY, source.DYNAMIC, OTHER_TENANT),
        metadata_action(MODEL_KEY, ROUTE_NAMESPACE, "model", source.ROUTE_ENTRY),
        _generic(PHASE_KEY, phase),
        metadata_action(KIND_KEY, TOKENS_NAMESPACE, "kind", source.DYNAMIC, UNARY),
        rc_pb2.RateLimit.Action(
            request_headers=rc_pb2.RateLimit.Action.RequestHeaders(
                header_name=RESERVATION_HEADER, descriptor_key=REQUEST_KEY
            )
        ),
    ]
    return rc_pb2.RateLimit(
        actions=actions,
        hits_addend=rc_pb2.RateLimit.HitsAddend(
            format=f"%DYNAMIC_METADATA({TOKENS_NAMESPACE}:{hits_key})%"
        ),
        apply_on_stream_done=phase == SETTLE,
    )


def token_filters(auth: EdgeAuth) -> list[hcm_pb2.HttpFilter]:
    """The admission Lua and the ratelimit filter; none unless some tenant has a token limit."""
    if not auth.token_limited:
        return []
    lua = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=lua_source()))
    service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=TOKEN_LIMITER_CLUSTER)
    )
    limit = rate_limit_pb2.RateLimit(
        domain=DOMAIN,
        stat_prefix="token_limit",
        timeout=duration(TIMEOUT_S),
        failure_mode_deny=not auth.token_limiter_fail_open,
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        rate_limited_as_resource_exhausted=True,
        rate_limit_service=rls_config_pb2.RateLimitServiceConfig(
            grpc_service=service, transport_api_version=config_source_pb2.V3
        ),
        rate_limits=[_policy(RESERVE, "reserve"), _policy(SETTLE, "used")],
    )
    return [
        hcm_pb2.HttpFilter(name=ADMISSION_FILTER, typed_config=packed(lua)),
        hcm_pb2.HttpFilter(name=LIMIT_FILTER, typed_config=packed(limit)),
    ]


def skip_unlimited(item: rc_pb2.Route, auth: EdgeAuth) -> rc_pb2.Route:
    """Turns both filters off on a model's route when no tenant has a token limit on that model,
    so its requests pay nothing for the others' limits (no body copy, no call). Routes that
    name no model (the body-routing route, server paths) keep them."""
    fields = item.metadata.filter_metadata[ROUTE_NAMESPACE].fields
    if "model" not in fields:
        return item
    model = fields["model"].string_value
    if any(t.token_limit_for(model) is not None for t in auth.tenants):
        return item
    for name in (ADMISSION_FILTER, LIMIT_FILTER):
        item.typed_per_filter_config[name].CopyFrom(packed(rc_pb2.FilterConfig(disabled=True)))
    return item


def _refused() -> tuple[str, accesslog_pb2.AccessLogFilter]:
    """The limiter's words, and the filter for a 429 that carries them."""
    message = f"%DYNAMIC_METADATA({RATELIMIT_NAMESPACE}:{MESSAGE_KEY})%"
    found = accesslog_pb2.MetadataFilter(
        matcher=metadata_pb2.MetadataMatcher(
            filter=RATELIMIT_NAMESPACE,
            path=[metadata_pb2.MetadataMatcher.PathSegment(key=MESSAGE_KEY)],
            value=value_pb2.ValueMatcher(present_match=True),
        )
    )
    found.match_if_key_not_found.value = False
    limited = edge.all_of(
        [edge.status_filter(429), accesslog_pb2.AccessLogFilter(metadata_filter=found)]
    )
    return message, limited


def refusal_mappers(auth: EdgeAuth) -> list[hcm_pb2.ResponseMapper]:
    """A token limit's 429 in the limiter's words (before the generic rate-limit mappers)."""
    if not auth.token_limited:
        return []
    message, limited = _refused()
    text = format_pb2.SubstitutionFormatString()
    text.text_format_source.inline_string = message
    return [
        hcm_pb2.ResponseMapper(
            filter=edge.all_of([limited, edge.rest_request()]),
            body_format_override=edge.json_error(message),
        ),
        hcm_pb2.ResponseMapper(filter=limited, body_format_override=text),
    ]


def openai_refusal_mappers(auth: EdgeAuth) -> list[hcm_pb2.ResponseMapper]:
    """A token limit's 429 under /v1, in OpenAI's error shape and the limiter's words: before
    the OpenAI API's own mappers, whose 429 names only a rate limit."""
    if not auth.token_limited:
        return []
    message, limited = _refused()
    kind, code = openai_edge.REPLY_KINDS[429]
    return [
        hcm_pb2.ResponseMapper(
            filter=edge.all_of([limited, openai_edge.openai_request()]),
            body_format_override=openai_edge.openai_error(message, kind, code),
        )
    ]
