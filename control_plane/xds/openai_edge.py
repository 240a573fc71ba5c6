"""The OpenAI-compatible API at the public listener: ``/v1/*`` routed by the body's ``model``.

- **Routing**: a POST to a generation path (``infermesh.wire.OPENAI_GENERATION_PATHS``) without
  ``x-model-name`` first matches an entry route whose only job is this module's Lua filter
  (off everywhere else: ``HttpFilter.disabled``). The filter reads the top-level JSON string
  ``model`` from the buffered body's first ``BODY_PREFIX_BYTES`` (a bounded scanner, no
  recursion, strings with escapes; a value that is not printable ASCII, or longer than
  ``MAX_MODEL_CHARS``, is left alone), sets ``x-model-name`` and clears the route cache. The
  request then matches its model's /v1 route, before the tenants' RBAC and rate limits run
  (so they see the model). Anything unreadable leaves the request alone: the entry route
  answers 400 naming the field, and a model the mesh does not route gets 404.
- **The model's /v1 routes** (``model_routes``) go to the model's REST twins with the model's
  version split and fallback, like ModelStreamInfer's routes: no overall timeout, an idle
  timeout of the model's ``timeout_s``, no retries, exempt from the unary stream duration (a
  completion may stream for as long as it generates). ``GET /v1/models/M`` goes there too.
- **GET /v1/models** goes to any model server (``rest:servers``), which lists the generative
  models it serves: the mesh's servers hold the same models unless placement says otherwise.
  For a tenant limited to some models (``tenants.T.models``) a Lua step (``visible_models``)
  first sets ``x-infermesh-visible-models`` to those models, from the identity authentication
  proved; the server lists only those. A tenant never learns the names of models it may not
  use. (GET /v1/models/M of such a model is refused by the tenants' RBAC.)
- **Bearer API keys** (``bearer_filter``): the OpenAI client sends ``Authorization: Bearer
  <api_key>``. With ``auth.mode: api_keys``, a Lua step before ``basic_auth`` rewrites
  ``Bearer TENANT.KEYID:SECRET`` to ``Basic base64(TENANT.KEYID:SECRET)``, so the same hashed
  keys, tenants RBAC and rate limits apply. (Envoy's ``api_key_auth`` filter takes Bearer keys
  natively but compares them in clear text: the keys would sit in Envoy's config.)
- **Envoy's own replies** under ``/v1`` are OpenAI's error JSON
  ``{"error": {"message", "type", "param", "code"}}`` (``reply_mappers``), so the openai
  client raises AuthenticationError on 401, PermissionDeniedError on 403 and so on.

Other engineers' Lua (affinity, token limits) may read the same bodies: ``LUA_JSON_FIELD`` is
the scanner, as a Lua chunk that defines ``json_field(s, key)``.
"""

from __future__ import annotations

from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import string_pb2

from control_plane.model.mesh import OTHER_TENANT, EdgeAuth
from control_plane.xds import edge, exposure
from control_plane.xds.envoy_values import packed
from control_plane.xds.lua_routing import LUA_FILTER
from control_plane.xds.lua_template import fill, lua_string, lua_strings
from control_plane.xds.namespaces import AUTH_NAMESPACE
from infermesh.wire import (
    MODEL_HEADER,
    OPENAI_GENERATION_PATHS,
    OPENAI_MODELS_PATH,
    OPENAI_ROOT,
    VISIBLE_MODELS_HEADER,
)

OPENAI_LUA_FILTER = "infermesh.lua.openai"
ROUTER_SCRIPT = "openai_router"
MODELS_SCRIPT = "visible_models"
MODELS_ROUTE = "openai:models"  # GET /v1/models: the list, narrowed by MODELS_SCRIPT
BEARER_LUA_FILTER = "infermesh.lua.bearer"
BODY_PREFIX_BYTES = 1 << 20  # a body's first bytes the scanner reads
MAX_MODEL_CHARS = 256
NO_MODEL_MESSAGE = (
    "you must provide a model parameter: a JSON string field 'model' in the request body "
    f"(or the {MODEL_HEADER} header)"
)
NOT_FOUND_MESSAGE = "The model does not exist in this mesh (GET /v1/models lists them)"

# A Lua chunk defining json_field(s, key): the top-level field ``key`` of the JSON object at
# the start of ``s`` when it is a string (a Lua string) or a number (a Lua number: e.g.
# max_tokens), else nil (not an object, no such field before ``s`` ends, another type, an
# escape other than \" \\ \/ or \u0020-\u007f). No recursion: nesting is a count.
LUA_JSON_FIELD = r"""
local JSON_ESCAPES = {['"'] = '"', ['\\'] = '\\', ['/'] = '/'}

-- Index just past the JSON string whose opening quote is at i, and its raw contents.
local function json_string_end(s, i)
  local pos = i + 1
  while true do
    local q = string.find(s, '["\\]', pos)
    if q == nil then return nil end
    if string.byte(s, q) == 92 then pos = q + 2 else return q + 1, string.sub(s, i + 1, q - 1) end
  end
end

local function json_unescape(raw)
  local out, pos = {}, 1
  while true do
    local b = string.find(raw, "\\", pos, true)
    if b == nil then out[#out + 1] = string.sub(raw, pos); return table.concat(out) end
    out[#out + 1] = string.sub(raw, pos, b - 1)
    local c = string.sub(raw, b + 1, b + 1)
    if JSON_ESCAPES[c] then
      out[#out + 1] = JSON_ESCAPES[c]; pos = b + 2
    elseif c == "u" and string.find(raw, "^00[2-7]%x", b + 2) then
      out[#out + 1] = string.char(tonumber(string.sub(raw, b + 2, b + 5), 16)); pos = b + 6
    else return nil end
  end
end

function json_field(s, key)
  local pos = string.find(s, "[^ \t\r\n]")
  if pos == nil or string.byte(s, pos) ~= 123 then return nil end
  pos = pos + 1
  local depth, expect_key = 0, true
  while true do
    local at = string.find(s, '[{}%[%]",]', pos)
    if at == nil then return nil end
    local c = string.byte(s, at)
    if c == 34 then
      local after, raw = json_string_end(s, at)
      if after == nil then return nil end
      pos = after
      if depth == 0 and expect_key then
        local _, colon = string.find(s, "^[ \t\r\n]*:[ \t\r\n]*", after)
        if colon == nil then return nil end
        if json_unescape(raw) == key then
          local number = string.match(s, "^-?%d+%.?%d*[eE]?[-+]?%d*", colon + 1)
          if number ~= nil then return tonumber(number) end
          if string.byte(s, colon + 1) ~= 34 then return nil end
          local value_end, value = json_string_end(s, colon + 1)
          if value_end == nil then return nil end
          return json_unescape(value)
        end
        expect_key, pos = false, colon + 1
      end
    elseif c == 123 or c == 91 then depth = depth + 1; pos = at + 1
    elseif c == 125 or c == 93 then
      if depth == 0 then return nil end
      depth = depth - 1; pos = at + 1
    else
      if depth == 0 then expect_key = true end
      pos = at + 1
    end
  end
end
"""

LUA_OPENAI_ROUTER = (
    LUA_JSON_FIELD
    + r"""
local OPENAI_PATHS = {}
for _, p in ipairs({PATHS}) do OPENAI_PATHS[p] = true end

function envoy_on_request(handle)
  local headers = handle:headers()
  local path = string.gsub(headers:get(":path") or "", "%?.*$", "")
  if headers:get("{MODEL_HEADER}") ~= nil or not OPENAI_PATHS[path] then return end
  local body = handle:body()
  if body == nil or body:length() < 2 then return end
  local ok, name = pcall(json_field, body:getBytes(0, math.min(body:length(), {PREFIX})), "model")
  if not ok or type(name) ~= "string" or #name > {MAX_CHARS} then return end
  if not string.find(name, "^[!-~]+$") then return end
  headers = handle:headers() -- a wrapper taken before a yield is dead after it
  headers:replace("{MODEL_HEADER}", name)
  handle:clearRouteCache()
end
"""
)

LUA_BEARER = r"""
-- Authorization: Bearer TENANT.KEYID:SECRET -> Basic base64(TENANT.KEYID:SECRET), for basic_auth.
function envoy_on_request(handle)
  local headers = handle:headers()
  local value = headers:get("authorization")
  if value == nil then return end
  local token = string.match(value, "^[Bb][Ee][Aa][Rr][Ee][Rr] +([^ ]+) *$")
  if token ~= nil then headers:replace("authorization", "Basic " .. handle:base64Escape(token)) end
end
"""


def lua_source() -> str:
    """The /v1 body-routing script with the wire's paths and header."""
    return fill(
        LUA_OPENAI_ROUTER,
        PATHS=lua_strings(OPENAI_GENERATION_PATHS),
        PREFIX=str(BODY_PREFIX_BYTES),
        MAX_CHARS=str(MAX_MODEL_CHARS),
        MODEL_HEADER=MODEL_HEADER,
    )


# Runs after authentication: the identity it proved is the "tenant" of AUTH_NAMESPACE's
# metadata. A tenant with no entry may use every model (or is refused by RBAC after this).
LUA_VISIBLE_MODELS = r"""
local VISIBLE = {VISIBLE_TABLE}  -- tenant -> its models, for those limited to some
local NAMED = {NAMED_TABLE}  -- every tenant with a policy of its own
local OTHER = {OTHER_LIST}  -- the models of identities not named (nil: every model)
function envoy_on_request(handle)
  local proved = handle:streamInfo():dynamicMetadata():get("{NAMESPACE}")
  local tenant = proved and proved["tenant"]
  if tenant == nil then return end
  local visible = VISIBLE[tenant]
  if visible == nil and NAMED[tenant] == nil then visible = OTHER end
  if visible ~= nil then handle:headers():replace("{HEADER}", visible) end
end
"""


def visible_models(auth: EdgeAuth) -> dict[str, str]:
    """Tenant -> the models it may use, comma separated, for tenants limited to some (the
    ``other`` policy's under its name); empty when authentication is off or none is limited."""
    if auth.mode == "off":
        return {}
    return {t.name: ",".join(t.models) for t in auth.tenants if "*" not in t.models}


def models_source(auth: EdgeAuth) -> str:
    """The visible_models script for ``auth``'s tenants."""
    visible = visible_models(auth)
    other = visible.pop(OTHER_TENANT, None)
    table = ", ".join(f"[{lua_string(t)}] = {lua_string(m)}" for t, m in sorted(visible.items()))
    named = ", ".join(f"[{lua_string(t.name)}] = true" for t in auth.named_tenants)
    return fill(
        LUA_VISIBLE_MODELS,
        VISIBLE_TABLE="{" + table + "}",
        NAMED_TABLE="{" + named + "}",
        OTHER_LIST="nil" if other is None else lua_string(other),
        NAMESPACE=AUTH_NAMESPACE,
        HEADER=VISIBLE_MODELS_HEADER,
    )


def router_filter(auth: EdgeAuth) -> hcm_pb2.HttpFilter:
    """The /v1 body router and the visible-models step: off unless a route turns one on (the
    entry routes), by the name of its script."""
    scripts = {ROUTER_SCRIPT: lua_source(), MODELS_SCRIPT: models_source(auth)}
    codes = {name: base_pb2.DataSource(inline_string=code) for name, code in scripts.items()}
    lua = lua_pb2.Lua(source_codes=codes)
    return hcm_pb2.HttpFilter(name=OPENAI_LUA_FILTER, typed_config=packed(lua), disabled=True)


def bearer_filter() -> hcm_pb2.HttpFilter:
    """Before basic_auth (auth mode api_keys): Bearer API keys become Basic credentials."""
    lua = lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=LUA_BEARER))
    return hcm_pb2.HttpFilter(name=BEARER_LUA_FILTER, typed_config=packed(lua))


# --- routes -----------------------------------------------------------------------------------


def _plain(item: rc_pb2.Route, script: str | None = None, lua: bool = False) -> rc_pb2.Route:
    """The gRPC body router off unless ``lua`` (an affinity model's routes: its script sets the
    affinity key from the body); this module's filter on with ``script`` if given."""
    if not lua:
        item.typed_per_filter_config[LUA_FILTER].Pack(lua_pb2.LuaPerRoute(disabled=True))
    if script is not None:
        enabled = rc_pb2.FilterConfig(config=packed(lua_pb2.LuaPerRoute(name=script)))
        item.typed_per_filter_config[OPENAI_LUA_FILTER].CopyFrom(packed(enabled))
    return item


def _model_header(model: str | None) -> rc_pb2.HeaderMatcher:
    if model is None:
        return rc_pb2.HeaderMatcher(name=MODEL_HEADER, present_match=True)
    return rc_pb2.HeaderMatcher(
        name=MODEL_HEADER, string_match=string_pb2.StringMatcher(exact=model)
    )


def model_routes(model: str, action: rc_pb2.RouteAction, lua: bool = False) -> list[rc_pb2.Route]:
    """``model``'s /v1 routes to ``action`` (its REST twins, as a stream): each generation
    path with ``x-model-name: model`` (the main Lua filter on if ``lua``), and ``GET
    /v1/models/model``."""
    routes = [
        _plain(rc_pb2.Route(
            name=f"openai:{model}:{path}", route=action,
            match=rc_pb2.RouteMatch(path=path, headers=[_model_header(model)]),
        ), lua=lua)
        for path in OPENAI_GENERATION_PATHS
    ]  # fmt: skip
    described = rc_pb2.RouteMatch(path=f"{OPENAI_MODELS_PATH}/{model}")
    described_route = rc_pb2.Route(name=f"openai:{model}:model", match=described, route=action)
    routes.append(_plain(described_route, lua=lua))
    return routes


def _direct(name: str, match: rc_pb2.RouteMatch, status: int, message: str) -> rc_pb2.Route:
    answer = rc_pb2.DirectResponseAction(status=status)
    answer.body.inline_string = message  # made OpenAI's error JSON by reply_mappers
    return rc_pb2.Route(name=name, match=match, direct_response=answer)


def entry_routes(to_servers: rc_pb2.RouteAction, auth: EdgeAuth) -> list[rc_pb2.Route]:
    """After every model's /v1 routes: the list of models (any server; narrowed for a tenant
    limited to some), 404 for a model the mesh does not route, and the generation paths
    without a model header, where the Lua filter runs (and, when it finds no model, 400)."""
    narrowed = MODELS_SCRIPT if visible_models(auth) else None
    routes = [
        _plain(rc_pb2.Route(
            name=MODELS_ROUTE, match=rc_pb2.RouteMatch(path=OPENAI_MODELS_PATH),
            route=to_servers,
        ), script=narrowed),
        _plain(_direct(
            "openai:model-not-found", rc_pb2.RouteMatch(prefix=OPENAI_MODELS_PATH + "/"), 404,
            NOT_FOUND_MESSAGE,
        )),
    ]  # fmt: skip
    for path in OPENAI_GENERATION_PATHS:
        named = rc_pb2.RouteMatch(path=path, headers=[_model_header(None)])
        routes.append(_plain(_direct(f"openai:not-found:{path}", named, 404, NOT_FOUND_MESSAGE)))
        routes.append(_plain(_direct(f"openai:no-model:{path}", rc_pb2.RouteMatch(path=path),
                                     400, NO_MODEL_MESSAGE), script=ROUTER_SCRIPT))  # fmt: skip
    return routes


# --- Envoy's own replies ---------------------------------------------------------------------


def openai_request(status: int | None = None) -> accesslog_pb2.AccessLogFilter:
    """A reply to a /v1 request, with HTTP status ``status`` if given."""
    path = rc_pb2.HeaderMatcher(
        name=":path", string_match=string_pb2.StringMatcher(prefix=OPENAI_ROOT + "/")
    )
    on_path = accesslog_pb2.AccessLogFilter(header_filter=accesslog_pb2.HeaderFilter(header=path))
    return on_path if status is None else edge.all_of([on_path, edge.status_filter(status)])


def openai_error(message: str, kind: str, code: str) -> Any:
    """A local reply body in OpenAI's error shape (``param``: none Envoy could name)."""
    fmt = substitution_format_string_pb2.SubstitutionFormatString()
    fmt.json_format.update(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    )
    return fmt


# status -> (OpenAI's error type, code) of Envoy's own replies under /v1
REPLY_KINDS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "model_not_found"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "unavailable"),
    504: ("server_error", "timeout"),
}


def reply_mappers(
    expose: tuple[str, ...], permission_message: str, rate_limited_message: str
) -> list[hcm_pb2.ResponseMapper]:
    """Envoy's own replies under /v1 as OpenAI's errors; to go before every other mapper."""

    def mapper(when: accesslog_pb2.AccessLogFilter, body: Any) -> hcm_pb2.ResponseMapper:
        return hcm_pb2.ResponseMapper(filter=when, body_format_override=body)

    unexposed = edge.all_of([openai_request(403), exposure.refused_request(expose)])
    refused = openai_error(exposure.refusal_message(expose), "permission_error", "not_exposed")
    denied = openai_error(permission_message, "permission_error", "permission_denied")
    limited = openai_error(rate_limited_message, *REPLY_KINDS[429])
    mappers = [
        mapper(unexposed, refused),
        mapper(openai_request(403), denied),
        mapper(openai_request(429), limited),
    ]
    for status, (kind, code) in REPLY_KINDS.items():
        if status != 429:
            body = openai_error("%LOCAL_REPLY_BODY%", kind, code)
            mappers.append(mapper(openai_request(status), body))
    other = openai_error("%LOCAL_REPLY_BODY%", "server_error", "edge_error")
    mappers.append(mapper(openai_request(), other))
    return mappers
