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
   server answered (no ``x-envoy-upstream-service-time``), settles 0. A model's routes skip
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
from control_plane.xds.lua_routing import LUA_VARINT
from control_plane.xds.lua_template import fill
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
from infermesh.wire import TOKENS_USED_HEADER

ADMISSION_FILTER = TOKEN_ADMISSION_FILTER
LIMIT_FILTER = TOKEN_LIMIT_FILTER
RATELIMIT_NAMESPACE = "envoy.filters.http.ratelimit"  # where the filter puts the service's metadata
TOKENS_NAMESPACE = "infermesh.tokens"  # dynamic metadata: {"reserve": bound, "used": tokens}
DEFAULT_MAX_TOKENS = 32  # the model server's default (model_server.generative.text)
STREAM_RESERVE = 512  # a ModelStreamInfer stream's reservation: the demo LM's context
MAX_RESERVE = 1_000_000_000  # Envoy's largest hits_addend
TIMEOUT_S = 1.0
RESERVATION_HEADER = "x-infermesh-token-reservation"  # set by the admission script only

LUA_TOKEN_ADMISSION = r"""
local GRPC = "/inference.GRPCInferenceService/"
local NS = "{NAMESPACE}"
local USED = "{USED_HEADER}"
local DEFAULT, STREAM, CAP = {DEFAULT_MAX}, {STREAM_RESERVE}, {MAX_RESERVE}
-- Bytes read for max_tokens: gRPC parameters (field 4) come before the tensors from every
-- common serializer; a JSON body's parameters may follow its inputs.
local READ = {grpc = 65536, json = 1048576}
local TWO63 = 9223372036854775808
-- Each reservation's own id: Envoy's x-request-id (which a client may choose) with this worker's
-- Lua state and a counter, in a header a client cannot send (x-infermesh-* are stripped first).
local SALT = string.gsub(tostring({}), "^table: ", "")
local serial = 0

{VARINT}
-- Walks the protobuf fields of s[pos, stop): calls on(field, wire, value, pos, len) per field
-- (value: a varint; pos/len: a length-delimited field's bytes). False if s is malformed, or
-- holds a group (wire types 3 and 4), which protobuf parsers skip and this walk does not.
local function fields(s, pos, stop, on)
  while pos < stop do
    local key, len
    key, pos = varint(s, pos)
    if key == nil then return false end
    local field, wire = math.floor(key / 8), key % 8
    if wire == 0 then
      len, pos = varint(s, pos)
      if len == nil then return false end
      on(field, 0, len, nil, nil)
    elseif wire == 1 then pos = pos + 8
    elseif wire == 5 then pos = pos + 4
    elseif wire == 2 then
      len, pos = varint(s, pos)
      if len == nil or pos + len > stop then return false end
      on(field, 2, nil, pos, len)
      pos = pos + len
    else return false end
  end
  return true
end

-- max_tokens of a ModelInferRequest (field 4: map<string, InferParameter>; int64 field 2,
-- uint64 field 5), nil when absent; and whether the walk could not read the message the way
-- the server's parser will (a group, a malformed field): then the bound is unread and the
-- context is reserved. A walk that only runs past the bytes read is not: a request that long
-- reserves more than the context already. A negative int64 (two's complement) reads as 0.
local function grpc_max_tokens(s)
  if #s < 5 or string.byte(s, 1) ~= 0 then return nil, false end
  local b1, b2, b3, b4 = string.byte(s, 2, 5)
  local length = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
  local stop = math.min(#s + 1, 6 + length)
  local found, unread = nil, false
  local whole = 6 + length <= #s + 1 -- the whole message was read, not just its start
  local function walk(pos, last, on)
    if not fields(s, pos, last, on) and (last < stop or whole) then unread = true end
  end
  walk(6, stop, function(field, wire, _, pos, len)
    if field ~= 4 or wire ~= 2 then return end
    local name, value = nil, nil
    walk(pos, pos + len, function(f, w, _, p, l)
      if f == 1 and w == 2 then name = string.sub(s, p, p + l - 1)
      elseif f == 2 and w == 2 then
        walk(p, p + l, function(pf, pw, v)
          if (pf == 2 or pf == 5) and pw == 0 then value = v end
        end)
      end
    end)
    if name == "max_tokens" and value ~= nil then
      if value >= TWO63 then value = 0 end -- negative: the server refuses it, naming it
      found = value
    end
  end)
  return found, unread
end

-- The largest max_tokens / max_completion_tokens of a JSON body (a negative one reads as 0).
local function json_max_tokens(s)
  local found = nil
  for _, key in ipairs({"max_tokens", "max_completion_tokens"}) do
    for number in string.gmatch(s, '"' .. key .. '"%s*:%s*(-?[%d%.eE+]+)') do
      local value = tonumber(number)
      if value ~= nil then
        if value < 0 then value = 0 end
        if found == nil or value > found then found = value end
      end
    end
  end
  return found
end

-- Whether a key of the JSON text s holds a \u escape. One pass: from each escape to the end
-- of the string that holds it (the next quote not itself escaped), then on after that string,
-- so no byte is read more than a few times. (A Lua pattern that looked for the same thing,
-- '"[^"]*\\u%x[^"]*"%s*:', backtracked: time quadratic in the body, about two minutes of an
-- Envoy worker for a 1 MiB string of escapes.)
local function escaped_key(s)
  local at = 1
  while true do
    local escape = string.find(s, "\\u", at, true)
    if escape == nil then return false end
    local quote = escape + 2
    while true do
      quote = string.find(s, '"', quote, true)
      if quote == nil then return false end
      local before = quote - 1
      while before >= escape and string.byte(s, before) == 92 do before = before - 1 end
      if (quote - 1 - before) % 2 == 0 then break end -- not escaped: the string's end
      quote = quote + 1
    end
    if string.find(s, "^%s*:", quote + 1) then return true end
    at = quote + 1
  end
end

local function is_inference(path)
  if path == nil then return nil end
  path = string.gsub(path, "%?.*$", "")
  if path == GRPC .. "ModelInfer" then return "grpc" end
  if path == GRPC .. "ModelStreamInfer" then return "stream" end
  if string.find(path, "^/v2/models/[^/]+/infer$") or
     string.find(path, "^/v2/models/[^/]+/versions/[^/]+/infer$") or
     path == "/v1/completions" or path == "/v1/chat/completions" then return "json" end
  return nil
end

function envoy_on_request(handle)
  local kind = is_inference(handle:headers():get(":path"))
  if kind == nil then return end
  local reserve = STREAM
  if kind ~= "stream" then
    local path = handle:headers():get(":path")
    local encoded = handle:headers():get("content-encoding")
    local body = handle:body()
    local size = body and body:length() or 0
    local wanted, unread = nil, false
    if size > 0 then
      local bytes = body:getBytes(0, math.min(size, READ[kind]))
      local ok, value, unreadable = pcall(
        kind == "grpc" and grpc_max_tokens or json_max_tokens, bytes)
      if ok then wanted = value end
      if kind == "grpc" then
        -- A compressed message, or one the walk reads otherwise than the server's parser.
        unread = string.byte(bytes, 1) ~= 0 or not ok or unreadable == true
      else
        -- A key spelled with an escape ("max_tok\u0065ns") is max_tokens to the server's
        -- JSON parser but not to the pattern above; a compressed body hides the key too.
        unread = escaped_key(bytes) or (encoded ~= nil and encoded ~= "identity")
      end
    end
    if unread then
      wanted = math.max(wanted or 0, STREAM) -- at most the context: prompt plus completion
    elseif wanted == nil and string.find(path or "", "^/v1/chat/completions") then
      wanted = STREAM -- a chat without max_tokens may take the rest of the context
    end
    reserve = size + (wanted or DEFAULT)
  end
  if reserve > CAP then reserve = CAP end
  if kind == "stream" then handle:streamInfo():dynamicMetadata():set(NS, "kind", "stream") end
  serial = serial + 1
  local headers = handle:headers() -- taken again: a wrapper taken before body() is dead after it
  local id = (headers:get("x-request-id") or "") .. "." .. SALT .. "." .. serial
  headers:replace("{ID_HEADER}", id)
  handle:streamInfo():dynamicMetadata():set(NS, "reserve", math.floor(reserve))
end

-- A streamed OpenAI answer's usage: an SSE comment line before [DONE] (headers leave before
-- the tokens are known, and the server writes no HTTP trailers). Generated text is JSON in
-- data: lines, where a newline is escaped, so only the server can begin a line with it.
local MARK = "\n: {USED_HEADER} "

local function marked(text)
  local at = string.find(text, MARK, 1, true)
  if at == nil then return nil end
  return string.match(text, "^(%d+)\n", at + #MARK)
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get(NS)
  if meta == nil or meta["reserve"] == nil then return end
  local headers = handle:headers()
  local used = headers:get(USED)
  -- A reply Envoy made itself (no healthy server, a refused connection, a timeout before any
  -- answer): no model ran, so nothing is used and the whole reservation goes back. Envoy's
  -- router marks a server's answer with x-envoy-upstream-service-time, but only when the
  -- whole request had arrived first: a stream's answers start while the client still sends,
  -- so on a stream only a trailers-only answer (grpc-status in the headers, no message; a
  -- server's own would carry the count with it) says nothing ran.
  if used == nil then
    if meta["kind"] == "stream" then
      if headers:get("grpc-status") ~= nil then used = 0 end
    elseif headers:get("x-envoy-upstream-service-time") == nil then
      used = 0
    end
  end
  if used == nil then
    local sse = string.find(headers:get("content-type") or "", "text/event-stream", 1, true)
    local tail = ""
    -- bodyChunks() passes each chunk on as it arrives: a stream is never held back here
    -- (trailers() alone would wait for the end with the whole body buffered).
    for chunk in handle:bodyChunks() do
      local n = chunk:length()
      if sse ~= nil and n > 0 then
        local text = tail .. chunk:getBytes(0, n)
        used = marked(text) or used
        tail = string.sub(text, -64)
      end
    end
    if used == nil then
      local trailers = handle:trailers()
      if trailers ~= nil then used = trailers:get(USED) end
    end
  end
  used = tonumber(used)
  if used ~= nil and used >= 0 and used <= CAP then
    handle:streamInfo():dynamicMetadata():set(NS, "used", math.floor(used))
  end
end
"""


def lua_source() -> str:
    return fill(
        LUA_TOKEN_ADMISSION,
        NAMESPACE=TOKENS_NAMESPACE,
        USED_HEADER=TOKENS_USED_HEADER,
        DEFAULT_MAX=str(DEFAULT_MAX_TOKENS),
        STREAM_RESERVE=str(STREAM_RESERVE),
        MAX_RESERVE=str(MAX_RESERVE),
        VARINT=LUA_VARINT.rstrip("\n"),
        ID_HEADER=RESERVATION_HEADER,
    )


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
