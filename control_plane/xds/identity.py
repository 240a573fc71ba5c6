"""Client identity and tenants at the public listener, with Envoy's own filters only.

The chain a request passes when ``listener.auth.mode`` is not "off" (``control_plane.xds.resources``
puts these around the body-routing Lua filter):

1. **Authentication**: ``api_keys``: Envoy's ``basic_auth`` checks ``Authorization: Basic
   base64(TENANT.KEYID:SECRET)`` against SHA-1 hashes (the secret is never in Envoy's config or
   ours) and forwards the key id in ``x-infermesh-key-id``. ``jwt``: ``jwt_authn`` checks a
   bearer token's signature (local JWKS), issuer, audience and expiry, and copies the tenant
   claim into a header. Either way a missing or bad credential is UNAUTHENTICATED / 401 (a JWT
   for another audience: PERMISSION_DENIED / 403, as Envoy answers it), and the message never
   holds the credential.
2. ``header_to_metadata`` turns that header into the dynamic metadata ``infermesh.auth:tenant``
   (for a key id, the part before the first '.'), which everything after reads. A client cannot
   forge it: every ``x-infermesh-*`` header is removed before any filter runs
   (``control_plane.xds.exposure``), and Envoy itself sets the header it is read from.
3. After the Lua filter (so a header-less gRPC call already carries ``x-model-name``), the
   **tenants RBAC** filter refuses (DENY rules, PERMISSION_DENIED / 403 naming the rule): a
   model the tenant may not use, a model version it may not choose (``x-model-version`` or a
   ``/versions/`` path), ``x-priority`` when it may not set one, and identities not listed when
   the topology has no ``other`` tenant. Its shadow rules, one per named tenant, only name the
   tenant that matched: that name (else nothing, read as ``other``) is the bounded **label**.
4. The **priority** and **version** RBAC filters have shadow rules only: ``allowed`` or
   ``denied`` tells the model server whether this tenant may set a priority or choose a version
   in the request body, which Envoy cannot read.
5. The **tenant rate limit** (Envoy's local_ratelimit, one filter for the listener so gRPC, REST
   and every version route of a model share one bucket): a token bucket per (label, model),
   RESOURCE_EXHAUSTED / 429 with ``retry-after`` when empty. Every identity labelled ``other``
   shares the ``other`` buckets.

Upstream, the virtual host sets ``x-infermesh-tenant`` (the identity), ``x-infermesh-tenant-label``
(named tenants only), ``x-infermesh-priority`` and ``x-infermesh-version`` (allowed / denied)
and removes the
``Authorization`` header, so no model server ever sees a credential.

Why it is one module of this length: the five steps above are one filter chain whose order
matters; each step is a section of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.basic_auth.v3 import basic_auth_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2 as h2m_pb2
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import metadata_pb2, path_pb2, regex_pb2, string_pb2, value_pb2
from envoy.type.metadata.v3 import metadata_pb2 as metadata_key_pb2
from envoy.type.v3 import token_bucket_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from control_plane.model.mesh import OTHER_TENANT, EdgeAuth, RateLimit, TenantPolicy
from control_plane.xds import edge
from control_plane.xds.envoy_values import packed, set_header
from control_plane.xds.namespaces import AUTH_NAMESPACE
from control_plane.xds.protection import enforced_bucket, retry_after_s, token_bucket
from infermesh.wire import (
    JWT_TENANT_HEADER,
    KEY_ID_HEADER,
    MODEL_HEADER,
    PRIORITY_HEADER,
    PRIORITY_PERMISSION_HEADER,
    TENANT_HEADER,
    TENANT_LABEL_HEADER,
    VERSION_HEADER,
    VERSION_PERMISSION_HEADER,
)

ROUTE_NAMESPACE = "infermesh"  # route metadata: {"model": name}
RBAC_NAMESPACE = "envoy.filters.http.rbac"  # where Envoy's RBAC filters write shadow results
BASIC_AUTH_FILTER = "envoy.filters.http.basic_auth"
JWT_FILTER = "envoy.filters.http.jwt_authn"
HEADER_TO_METADATA_FILTER = "envoy.filters.http.header_to_metadata"
TENANTS_RBAC_FILTER = "infermesh.tenants"
PRIORITY_RBAC_FILTER = "infermesh.priority"
VERSION_RBAC_FILTER = "infermesh.version"
TENANT_RATE_LIMIT_FILTER = "infermesh.tenant_rate_limit"
TOKEN_ADMISSION_FILTER = "infermesh.token_admission"  # control_plane.xds.token_admission
TOKEN_LIMIT_FILTER = "infermesh.token_limit"
LABEL_PREFIX = "tenant_label_"
PRIORITY_PREFIX = "priority_"
VERSION_PREFIX = "version_"
LABEL_KEY = f"{LABEL_PREFIX}shadow_effective_policy_id"
PRIORITY_KEY = f"{PRIORITY_PREFIX}shadow_engine_result"
VERSION_KEY = f"{VERSION_PREFIX}shadow_engine_result"
JWT_PROVIDER = "infermesh"
JWT_PAYLOAD_KEY = "payload"
UNLIMITED_TOKENS = 1_000_000_000  # the default bucket: requests no descriptor names
TENANT_RATE_LIMITED = "tenant"  # x-infermesh-rate-limited on a tenant's 429
# A reply the tenants' rules (or jwt_authn's audience check) refused, in words.
TENANT_VALUE = f"%DYNAMIC_METADATA({AUTH_NAMESPACE}:tenant)%"  # the identity, as Envoy formats it
PERMISSION_MESSAGE = f"permission denied: %RESPONSE_CODE_DETAILS% (identity {TENANT_VALUE})"


def _filter(name: str, config: Message) -> hcm_pb2.HttpFilter:
    return hcm_pb2.HttpFilter(name=name, typed_config=packed(config))


# --- 1 and 2: authentication, then the identity as metadata ---------------------------------


def authentication_filters(auth: EdgeAuth) -> list[hcm_pb2.HttpFilter]:
    """basic_auth or jwt_authn, then header_to_metadata; none when auth is off."""
    if auth.mode == "api_keys":
        users = "".join(f"{k.key_id}:{{SHA}}{k.sha1_b64}\n" for k in auth.api_keys)
        basic = basic_auth_pb2.BasicAuth(
            users=base_pb2.DataSource(inline_string=users), forward_username_header=KEY_ID_HEADER
        )
        # TENANT.KEYID -> TENANT
        rewrite = regex_pb2.RegexMatchAndSubstitute(
            pattern=regex_pb2.RegexMatcher(regex=r"^([^.]+)\..*$"), substitution=r"\1"
        )
        return [_filter(BASIC_AUTH_FILTER, basic), _to_metadata(KEY_ID_HEADER, rewrite, False)]
    if auth.mode == "jwt" and auth.jwt is not None:
        jwt = auth.jwt
        provider = jwt_pb2.JwtProvider(
            # Only the header: a token in a query string (jwt_authn's other default place)
            # would stay in the path Envoy logs and forwards.
            from_headers=[jwt_pb2.JwtHeader(name="authorization", value_prefix="Bearer ")],
            issuer=jwt.issuer,
            payload_in_metadata=JWT_PAYLOAD_KEY,  # a verified token, for the refusal's words
            audiences=list(jwt.audiences),
            local_jwks=base_pb2.DataSource(inline_string=jwt.jwks),
            claim_to_headers=[
                jwt_pb2.JwtClaimToHeader(header_name=JWT_TENANT_HEADER, claim_name=jwt.tenant_claim)
            ],
        )
        rule = jwt_pb2.RequirementRule(
            match=rc_pb2.RouteMatch(prefix="/"),
            requires=jwt_pb2.JwtRequirement(provider_name=JWT_PROVIDER),
        )
        config = jwt_pb2.JwtAuthentication(providers={JWT_PROVIDER: provider}, rules=[rule])
        return [_filter(JWT_FILTER, config), _to_metadata(JWT_TENANT_HEADER, None, True)]
    return []


def _to_metadata(
    header: str, rewrite: regex_pb2.RegexMatchAndSubstitute | None, remove: bool
) -> hcm_pb2.HttpFilter:
    pair = h2m_pb2.Config.KeyValuePair(metadata_namespace=AUTH_NAMESPACE, key="tenant")
    if rewrite is not None:
        pair.regex_value_rewrite.CopyFrom(rewrite)
    rule = h2m_pb2.Config.Rule(header=header, on_header_present=pair, remove=remove)
    return _filter(HEADER_TO_METADATA_FILTER, h2m_pb2.Config(request_rules=[rule]))


# --- 3 and 4: what each tenant may do ------------------------------------------------------


def _tenant_matcher(value: value_pb2.ValueMatcher) -> metadata_pb2.MetadataMatcher:
    path = [metadata_pb2.MetadataMatcher.PathSegment(key="tenant")]
    return metadata_pb2.MetadataMatcher(filter=AUTH_NAMESPACE, path=path, value=value)


def _tenant_is(name: str) -> rbac_pb2.Principal:
    exact = value_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(exact=name))
    sourced = rbac_pb2.SourcedMetadata(metadata_matcher=_tenant_matcher(exact))
    return rbac_pb2.Principal(sourced_metadata=sourced)


def principal(policy: TenantPolicy, auth: EdgeAuth) -> rbac_pb2.Principal:
    """The identities ``policy`` applies to: its name, or (``other``) no named tenant."""
    if policy.name != OTHER_TENANT:
        return _tenant_is(policy.name)
    named = [_tenant_is(t.name) for t in auth.named_tenants]
    if not named:
        return rbac_pb2.Principal(any=True)
    return rbac_pb2.Principal(not_id=rbac_pb2.Principal(or_ids=rbac_pb2.Principal.Set(ids=named)))


def _path(regex: str) -> rbac_pb2.Permission:
    matcher = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=regex))
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=matcher))


def _header(name: str, exact: str | None = None) -> rbac_pb2.Permission:
    if exact is None:
        return rbac_pb2.Permission(header=rc_pb2.HeaderMatcher(name=name, present_match=True))
    match = string_pb2.StringMatcher(exact=exact)
    return rbac_pb2.Permission(header=rc_pb2.HeaderMatcher(name=name, string_match=match))


def _all(*rules: rbac_pb2.Permission) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(and_rules=rbac_pb2.Permission.Set(rules=list(rules)))


def _any(rules: Iterable[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(or_rules=rbac_pb2.Permission.Set(rules=list(rules)))


def _not(rule: rbac_pb2.Permission) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(not_rule=rule)


REST_MODEL_PATH = "/v2/models/[^/]+(/.*)?"
OPENAI_MODEL_PATH = "/v1/models/[^/]+"  # GET /v1/models/M: the model is in the path


def other_model(models: tuple[str, ...]) -> rbac_pb2.Permission:
    """A request about a model not in ``models``: by its REST path (``/v2/models/M...``, or
    the OpenAI API's ``/v1/models/M``) or, on every other path, by ``x-model-name`` (set by
    the client, or by Lua from the body: a gRPC message, or /v1 JSON's "model")."""
    names = "|".join(re.escape(m) for m in models)
    rest = _all(_path(REST_MODEL_PATH), _not(_path(f"/v2/models/({names})(/.*)?")))
    described = _all(_path(OPENAI_MODEL_PATH), _not(_path(f"/v1/models/({names})")))
    on_grpc = _all(
        _not(_path("/v2(/.*)?")),
        _header(MODEL_HEADER),
        _not(_any(_header(MODEL_HEADER, m) for m in models)),
    )
    return _any([rest, described, on_grpc])


VERSION_CHOSEN = _any([_header(VERSION_HEADER), _path("/v2/models/[^/]+/versions/.*")])


def _policy(permission: rbac_pb2.Permission, who: rbac_pb2.Principal) -> rbac_pb2.Policy:
    return rbac_pb2.Policy(permissions=[permission], principals=[who])


def deny_rules(auth: EdgeAuth) -> dict[str, rbac_pb2.Policy]:
    """Policy name (Envoy puts it, spaces as '_', in the refusal) -> what is refused."""
    rules: dict[str, rbac_pb2.Policy] = {}
    for tenant in auth.tenants:
        who = principal(tenant, auth)
        name = f"tenant {tenant.name}"
        if "*" not in tenant.models:
            allowed = ", ".join(tenant.models) or "none"
            rules[f"{name} may not use this model (it may use: {allowed})"] = _policy(
                other_model(tenant.models), who
            )
        if not tenant.may_pick_version:
            rules[f"{name} may not choose a model version"] = _policy(VERSION_CHOSEN, who)
        if not tenant.may_set_priority:
            rules[f"{name} may not set {PRIORITY_HEADER}"] = _policy(_header(PRIORITY_HEADER), who)
    everything = rbac_pb2.Permission(any=True)
    if auth.tenant(OTHER_TENANT) is None:
        stranger = principal(TenantPolicy(OTHER_TENANT), auth)
        rules["identity is not a tenant of this mesh"] = _policy(everything, stranger)
    # A credential that proved no tenant (a JWT without the tenant claim) is no identity.
    sourced = rbac_pb2.SourcedMetadata(metadata_matcher=_tenant_matcher(_ANY_VALUE))
    nameless = rbac_pb2.Principal(not_id=rbac_pb2.Principal(sourced_metadata=sourced))
    rules["credential names no tenant"] = _policy(everything, nameless)
    return rules


def tenant_rules(auth: EdgeAuth) -> list[hcm_pb2.HttpFilter]:
    """The tenants, priority and version RBAC filters (after Lua); none when auth is off."""
    if auth.mode == "off":
        return []
    anyone = [rbac_pb2.Permission(any=True)]
    tenants = rbac_filter_pb2.RBAC(
        rules=rbac_pb2.RBAC(action=rbac_pb2.RBAC.DENY, policies=deny_rules(auth)),
        rules_stat_prefix="tenants.",
        shadow_rules=rbac_pb2.RBAC(
            action=rbac_pb2.RBAC.ALLOW,
            policies={
                t.name: rbac_pb2.Policy(permissions=anyone, principals=[_tenant_is(t.name)])
                for t in auth.named_tenants
            },
        ),
        shadow_rules_stat_prefix=LABEL_PREFIX,
    )
    filters = [
        _filter(TENANTS_RBAC_FILTER, tenants),
        _filter(PRIORITY_RBAC_FILTER, _grant(auth, "may_set_priority", PRIORITY_PREFIX)),
        _filter(VERSION_RBAC_FILTER, _grant(auth, "may_pick_version", VERSION_PREFIX)),
    ]
    return filters


def _grant(auth: EdgeAuth, permission: str, prefix: str) -> rbac_filter_pb2.RBAC:
    """Shadow rules only: "allowed" for the tenants with ``permission``, else "denied", in the
    metadata PREFIX + shadow_engine_result (for the model servers, which read the body)."""
    trusted = [principal(t, auth) for t in auth.tenants if getattr(t, permission)]
    anyone = [rbac_pb2.Permission(any=True)]
    policies = {permission: rbac_pb2.Policy(permissions=anyone, principals=trusted)}
    return rbac_filter_pb2.RBAC(
        shadow_rules=rbac_pb2.RBAC(
            action=rbac_pb2.RBAC.ALLOW, policies=policies if trusted else {}
        ),
        shadow_rules_stat_prefix=prefix,
    )


# --- 5: rate limits per tenant and model -----------------------------------------------------


def metadata_action(
    descriptor: str, namespace: str, key: str, source: int, default: str = ""
) -> rc_pb2.RateLimit.Action:
    data = rc_pb2.RateLimit.Action.MetaData(
        descriptor_key=descriptor,
        metadata_key=metadata_key_pb2.MetadataKey(
            key=namespace, path=[metadata_key_pb2.MetadataKey.PathSegment(key=key)]
        ),
        default_value=default,
        source=source,
    )
    return rc_pb2.RateLimit.Action(metadata=data)


def _descriptor(
    entries: tuple[tuple[str, str], ...], bucket: token_bucket_pb2.TokenBucket
) -> ratelimit_pb2.LocalRateLimitDescriptor:
    return ratelimit_pb2.LocalRateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries],
        token_bucket=bucket,
    )


def tenant_rate_limit_filter(auth: EdgeAuth, models: tuple[str, ...]) -> list[hcm_pb2.HttpFilter]:
    """The tenant rate limit filter, or none (auth off, or no tenant has a limit)."""
    limit = tenant_rate_limit(auth, models) if auth.mode != "off" else None
    return [] if limit is None else [_filter(TENANT_RATE_LIMIT_FILTER, limit)]


def tenant_rate_limit(
    auth: EdgeAuth, models: tuple[str, ...]
) -> local_rate_limit_pb2.LocalRateLimit | None:
    """One bucket per (tenant label, model) that has a limit; None when no tenant has one."""
    descriptors = []
    waits = []
    for tenant in auth.tenants:
        for model in models:
            limit = tenant.limit_for(model)
            if limit is None or not tenant.may_use(model):
                continue
            bucket = token_bucket(limit)
            waits.append(retry_after_s(bucket))
            entries = (("tenant", tenant.name), ("model", model))
            descriptors.append(_descriptor(entries, bucket))
    if not descriptors:
        return None
    retry_after = max(waits)
    source = rc_pb2.RateLimit.Action.MetaData
    actions = [
        metadata_action("tenant", RBAC_NAMESPACE, LABEL_KEY, source.DYNAMIC, OTHER_TENANT),
        metadata_action("model", ROUTE_NAMESPACE, "model", source.ROUTE_ENTRY),
    ]
    default = token_bucket(RateLimit(UNLIMITED_TOKENS, UNLIMITED_TOKENS))
    config = enforced_bucket("tenant_rate_limit", default, retry_after, TENANT_RATE_LIMITED)
    config.rate_limits.append(rc_pb2.RateLimit(actions=actions))
    config.descriptors.extend(descriptors)
    return config


# --- upstream headers, refusals in words, the model of a route ------------------------------


def _shadow_result(key: str) -> str:
    """An RBAC filter's shadow result ``key``, as Envoy formats it in a header or a log."""
    return f"%DYNAMIC_METADATA({RBAC_NAMESPACE}:{key})%"


def upstream_headers(auth: EdgeAuth) -> tuple[list[base_pb2.HeaderValueOption], list[str]]:
    """(headers the virtual host sets, headers it removes) on every request sent upstream."""
    if auth.mode == "off":
        return [], []
    added = [
        set_header(TENANT_HEADER, TENANT_VALUE),
        set_header(TENANT_LABEL_HEADER, _shadow_result(LABEL_KEY)),
        set_header(PRIORITY_PERMISSION_HEADER, _shadow_result(PRIORITY_KEY)),
        set_header(VERSION_PERMISSION_HEADER, _shadow_result(VERSION_KEY)),
    ]
    return added, ["authorization"]


def refusal_mappers(auth: EdgeAuth) -> list[hcm_pb2.ResponseMapper]:
    """A 403 to a caller whose credential was verified (a tenant, or a JWT payload) is the
    tenants' rules' refusal: JSON on REST, the gRPC message otherwise, naming the rule. (A JWT
    for another audience is refused before it is verified, in jwt_authn's own words.)"""
    if auth.mode == "off":
        return []
    text = substitution_format_string_pb2.SubstitutionFormatString()
    text.text_format_source.inline_string = PERMISSION_MESSAGE
    verified = _present(_tenant_matcher(_ANY_VALUE))
    if auth.mode == "jwt":  # a JWT verified, whether or not it named a tenant
        both_kinds = [verified, _present(_JWT_PAYLOAD)]
        verified = accesslog_pb2.AccessLogFilter(
            or_filter=accesslog_pb2.OrFilter(filters=both_kinds)
        )
    refused = edge.all_of([edge.status_filter(403), verified])
    both = edge.all_of([refused, edge.rest_request()])
    return [
        hcm_pb2.ResponseMapper(
            filter=both, body_format_override=edge.json_error(PERMISSION_MESSAGE)
        ),
        hcm_pb2.ResponseMapper(filter=refused, body_format_override=text),
    ]


_ANY_VALUE = value_pb2.ValueMatcher(present_match=True)
_JWT_PAYLOAD = metadata_pb2.MetadataMatcher(
    filter=JWT_FILTER,
    path=[metadata_pb2.MetadataMatcher.PathSegment(key=JWT_PAYLOAD_KEY)],
    value=_ANY_VALUE,
)


def _present(matcher: metadata_pb2.MetadataMatcher) -> accesslog_pb2.AccessLogFilter:
    """A reply whose request has the metadata ``matcher`` names."""
    found = accesslog_pb2.MetadataFilter(matcher=matcher)
    found.match_if_key_not_found.value = False  # Envoy's default matches a missing key
    return accesslog_pb2.AccessLogFilter(metadata_filter=found)


def mark_model(item: rc_pb2.Route, model: str) -> rc_pb2.Route:
    """Names the route's model in its metadata, for the tenant rate limit's descriptor."""
    fields = struct_pb2.Struct()
    fields.update({"model": model})
    item.metadata.filter_metadata[ROUTE_NAMESPACE].CopyFrom(fields)
    return item


def unauthenticated(item: rc_pb2.Route) -> rc_pb2.Route:
    """A route the authentication and tenant filters skip: CORS preflights, which browsers
    send without credentials (Envoy's CORS filter answers them; they never reach a server)."""
    names = (BASIC_AUTH_FILTER, JWT_FILTER, TENANTS_RBAC_FILTER, PRIORITY_RBAC_FILTER,
             VERSION_RBAC_FILTER, TENANT_RATE_LIMIT_FILTER, TOKEN_ADMISSION_FILTER,
             TOKEN_LIMIT_FILTER)  # fmt: skip
    for name in names:
        item.typed_per_filter_config[name].CopyFrom(packed(rc_pb2.FilterConfig(disabled=True)))
    return item


def access_log_fields(auth: EdgeAuth) -> dict[str, str]:
    """The tenant columns of Envoy's JSON access log."""
    if auth.mode == "off":
        return {}
    return {"tenant": TENANT_VALUE, "tenant_label": _shadow_result(LABEL_KEY)}
