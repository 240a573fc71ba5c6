"""The token admission script (Lua) that ``control_plane.xds.token_admission`` installs at
the edge: how it sizes a request's reservation from its body and finds the tokens used in the
response (the chain around it is that module's docstring). A module of its own, apart from
the filters that carry it, because the script alone is two hundred lines.
"""

from __future__ import annotations

from control_plane.xds.lua_routing import LUA_VARINT
from control_plane.xds.lua_template import fill
from infermesh.wire import TOKENS_USED_HEADER

TOKENS_NAMESPACE = "infermesh.tokens"  # dynamic metadata: {"reserve": bound, "used": tokens}
DEFAULT_MAX_TOKENS = 32  # the model server's default (model_server.generative.text)
STREAM_RESERVE = 512  # a ModelStreamInfer stream's reservation: the demo LM's context
MAX_RESERVE = 1_000_000_000  # Envoy's largest hits_addend
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
